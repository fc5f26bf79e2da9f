"""What opting a graph's kernel nodes into device-side updates costs, kernel by kernel kind.

    python3 bench/device_updatable.py --out OUT [--touch-cubin touch_nodes.cubin]

Captures a few calls (cuBLAS matmuls through ``torch.matmul`` at GPT-2's prefill shapes in
fp16, and an element-wise kernel) into CUDA graphs: as captured, and with every kernel node
made device-updatable (``CU_LAUNCH_ATTRIBUTE_DEVICE_UPDATABLE_KERNEL_NODE``, as
``runtime/topology_graph.py`` does), nothing ever updated. With ``--touch-cubin``
(``bench/kernels/touch_nodes.cu`` built with ``nvcc --cubin -arch=sm_90``), three more, each
with a head node before the captured ones, as grape's patch node: one that updates nothing,
one that sets every node's grid to the grid it has on the first launch only, and one that
does so on every launch. Times launches of each (CUDA events over back-to-back launches) and
lists each node's kernel and cluster dims. Prints a table, writes ``device_updatable.json``.
Needs torch, cuda-python and grape-tvm's runtime on a GPU host.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from cuda.bindings import driver

from grape_tvm.runtime.cuda_compile import kernel_params
from grape_tvm.runtime.cuda_driver import check
from grape_tvm.runtime.cuda_graph import add_head_node, kernel_nodes
from grape_tvm.runtime.topology_graph import kernel_node_params, make_device_updatable


def capture(fn, stream: torch.cuda.Stream):
    """``fn``'s launches on ``stream`` as a CUgraph (not instantiated)."""
    handle = driver.CUstream(stream.cuda_stream)
    with torch.cuda.stream(stream):
        check(driver.cuStreamBeginCapture(
            handle, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
            "cuStreamBeginCapture")
        fn()
        return check(driver.cuStreamEndCapture(handle), "cuStreamEndCapture")


def describe(node) -> dict:
    params = check(driver.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
    try:
        name = check(driver.cuFuncGetName(params.func), "cuFuncGetName")
    except Exception:  # pylint: disable=broad-except
        name = b"?"
    cluster = check(driver.cuGraphKernelNodeGetAttribute(
        node, driver.CUkernelNodeAttrID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION),
        "cuGraphKernelNodeGetAttribute").clusterDim
    return {"kernel": (name.decode() if isinstance(name, bytes) else str(name))[:80],
            "grid": [params.gridDimX, params.gridDimY, params.gridDimZ],
            "block": [params.blockDimX, params.blockDimY, params.blockDimZ],
            "cluster": [cluster.x, cluster.y, cluster.z]}


def make_updatable(graph) -> list[int]:
    """Opt every kernel node in, as topology graphs do; their device handles."""
    return [make_device_updatable(node) for node in kernel_nodes(graph)]


class TouchHead:
    """A head node launching ``touch_nodes`` over a graph's device-updatable nodes."""

    def __init__(self, cubin: Path):
        self.module = check(driver.cuModuleLoadData(cubin.read_bytes()), "cuModuleLoadData")
        self.function = check(driver.cuModuleGetFunction(self.module, b"touch_nodes"),
                              "cuModuleGetFunction")
        self.keep = []  # device buffers and parameter storage, alive with the graphs

    def add(self, graph, handles: list[int], mode: str) -> None:
        """``mode``: "none" (returns at once), "once" (first launch), "every" launch."""
        import numpy as np  # pylint: disable=import-outside-toplevel

        grids = []
        for node in kernel_nodes(graph):
            p = check(driver.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
            grids += [p.gridDimX, p.gridDimY, p.gridDimZ]
        nodes_t = torch.tensor(np.array(handles, np.uint64).view(np.int64), device="cuda")
        grids_t = torch.tensor(grids, dtype=torch.int32, device="cuda")
        done_t = torch.tensor([1 if mode == "none" else 0], dtype=torch.int32, device="cuda")
        storage = kernel_params([("u64", nodes_t.data_ptr()), ("u64", grids_t.data_ptr()),
                                 ("u32", len(handles)), ("u64", done_t.data_ptr()),
                                 ("u32", 0 if mode == "every" else 1)])
        self.keep += [nodes_t, grids_t, done_t, storage]
        add_head_node(graph, kernel_node_params(self.function, 1, 64, 0, storage), "touch")


def launched_us(exec_, stream, launches: int = 200) -> float:
    """us per launch of an instantiated graph: five launches, then ``launches`` timed."""
    handle = driver.CUstream(stream.cuda_stream)
    for _ in range(5):
        check(driver.cuGraphLaunch(exec_, handle), "cuGraphLaunch")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        for _ in range(launches):
            check(driver.cuGraphLaunch(exec_, handle), "cuGraphLaunch")
        end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / launches


def instantiated(graph, stream):
    exec_ = check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    check(driver.cuGraphUpload(exec_, driver.CUstream(stream.cuda_stream)), "cuGraphUpload")
    return exec_


def time_us(graph, stream) -> float:
    exec_ = instantiated(graph, stream)
    took = launched_us(exec_, stream)
    check(driver.cuGraphExecDestroy(exec_), "cuGraphExecDestroy")
    return took


def host_reset_us(graph, stream) -> tuple[float, float]:
    """Time launches after the head node's updates (as ``time_us``), then set every kernel
    node's parameters again from the host (its captured ones: cuGraphExecKernelNodeSetParams,
    which overrides device-side updates from the next upload), upload, and time again."""
    exec_ = instantiated(graph, stream)
    updated = launched_us(exec_, stream)
    for node in kernel_nodes(graph):
        params = check(driver.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
        check(driver.cuGraphExecKernelNodeSetParams(exec_, node, params),
              "cuGraphExecKernelNodeSetParams")
    check(driver.cuGraphUpload(exec_, driver.CUstream(stream.cuda_stream)), "cuGraphUpload")
    reset = launched_us(exec_, stream)
    check(driver.cuGraphExecDestroy(exec_), "cuGraphExecDestroy")
    return updated, reset


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--touch-cubin", type=Path, default=None,
                        help="bench/kernels/touch_nodes.cu built for this GPU")
    args = parser.parse_args()
    stream = torch.cuda.Stream()
    torch.empty(1, device="cuda")  # the runtime makes the primary context current first
    touch = TouchHead(args.touch_cubin) if args.touch_cubin else None
    cases = {}
    for m in (16, 128, 1024):
        x = torch.randn(m, 768, device="cuda", dtype=torch.float16)
        w = torch.randn(768, 3072, device="cuda", dtype=torch.float16)
        y = torch.empty(m, 3072, device="cuda", dtype=torch.float16)
        cases[f"matmul {m}x768x3072 fp16 x4"] = (lambda x=x, w=w, y=y: [torch.matmul(x, w, out=y)
                                                                       for _ in range(4)])
    x = torch.randn(128, 768, device="cuda")
    w = torch.randn(768, 3072, device="cuda")
    y = torch.empty(128, 3072, device="cuda")
    cases["matmul 128x768x3072 fp32 x4"] = lambda: [torch.matmul(x, w, out=y) for _ in range(4)]
    a = torch.randn(1 << 20, device="cuda")
    cases["add 1M fp32 x4"] = lambda: [torch.add(a, 1.0, out=a) for _ in range(4)]
    results = {}
    for name, fn in cases.items():
        with torch.cuda.stream(stream):
            fn()  # cuBLAS's handle and workspace for this stream, before any capture
        torch.cuda.synchronize()
        plain, updatable = capture(fn, stream), capture(fn, stream)
        make_updatable(updatable)
        results[name] = {"nodes": [describe(n) for n in kernel_nodes(plain)],
                         "as_captured_us": time_us(plain, stream),
                         "device_updatable_us": time_us(updatable, stream)}
        if touch is not None:
            for mode in ("none", "once", "every"):
                graph = capture(fn, stream)
                handles = make_updatable(graph)
                touch.add(graph, handles, mode)
                results[name][f"head_updating_{mode}_us"] = time_us(graph, stream)
            graph = capture(fn, stream)
            touch.add(graph, make_updatable(graph), "once")
            once, reset = host_reset_us(graph, stream)
            results[name]["once_then_host_reset_us"] = {"before": once, "after": reset}
        r = results[name]
        print(f"{name:32} " + "  ".join(f"{k[:-3]} {v:7.1f}" for k, v in r.items()
                                        if k.endswith("_us") and isinstance(v, float)) +
              f"  once, then reset from the host: {r.get('once_then_host_reset_us')}" +
              f"  nodes {[(n['kernel'][:40], n['cluster']) for n in r['nodes'][:1]]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "device_updatable.json").write_text(json.dumps({
        "machine": torch.cuda.get_device_name(), "torch": torch.__version__,
        "what": "us per launch of a graph of the case's kernels, back to back, CUDA events; "
                "device_updatable: every kernel node opted into device-side updates, none made; "
                "head_updating_{none,once,every}: and a head node setting every node's grid to "
                "its own value never, on the first launch, on every launch; once_then_host_reset: "
                "updated once, then every node's parameters set from the host and uploaded",
        "cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
