"""Micro-benchmark: what does it cost to patch device-updatable graph nodes from the device?

A graph of one head kernel and a chain of ``count`` tiny kernels; on every launch the head
changes each node's grid and one int64 parameter (what a call at a new n does to grape's
graphs). Variants of the head (bench/kernels/patch_variants.cu): one call per field from one
thread, one batched ``cudaGraphKernelNodeUpdatesApply`` from one thread, a thread per node
with calls per field, a thread per node with one batched call each, and no patch at all.

    python3 bench/patch_variants.py --out OUT_DIR   (on the GPU host; nvcc compiles the head)
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

from grape_tvm.runtime.cuda_compile import compile_cubin
from grape_tvm.runtime.cuda_driver import check, driver
from grape_tvm.runtime.cuda_compile import kernel_params
from grape_tvm.runtime.topology_graph import DeviceBuffer, make_device_updatable

SOURCE = Path(__file__).resolve().parent / "kernels" / "patch_variants.cu"
VARIANTS = {  # name: (kernel, threads, batched)
    "none": ("patch_none", 1, False),
    "one_thread_per_field": ("patch_fields", 1, False),
    "one_thread_batched": ("patch_batched", 1, True),
    "thread_per_node": ("patch_parallel", 64, False),
    "thread_per_node_batched": ("patch_parallel_batched", 64, True),
}
UPDATE_BYTES = 64  # sizeof(cudaGraphKernelNodeUpdate) is at most this


def _node_params(func, grid: int, block: int, storage) -> object:
    p = driver.CUDA_KERNEL_NODE_PARAMS()
    p.func = func
    p.gridDimX, p.gridDimY, p.gridDimZ = grid, 1, 1
    p.blockDimX, p.blockDimY, p.blockDimZ = block, 1, 1
    p.sharedMemBytes = 0
    p.kernelParams = ctypes.addressof(storage[1])
    return p


def run_variant(module, name: str, count: int, stream, launches: int) -> float:
    kernel, threads, batched = VARIANTS[name]
    head_func = check(driver.cuModuleGetFunction(module, kernel.encode()), "cuModuleGetFunction")
    work = check(driver.cuModuleGetFunction(module, b"work"), "cuModuleGetFunction")
    nodes_buf, state = DeviceBuffer(8 * count), DeviceBuffer(16)
    scratch, values, out = DeviceBuffer(2 * count * UPDATE_BYTES), DeviceBuffer(8 * count), DeviceBuffer(4096)
    state.write(bytes(16))
    head_args = [("u64", nodes_buf.address), ("u32", count), ("u64", state.address)]
    if batched:
        head_args += [("u64", scratch.address), ("u64", values.address)]
    keep = [kernel_params(head_args)]
    graph = check(driver.cuGraphCreate(0), "cuGraphCreate")
    prev = check(driver.cuGraphAddKernelNode(graph, None, 0, _node_params(head_func, 1, threads, keep[0])),
                 "cuGraphAddKernelNode")
    chain = []
    for _ in range(count):
        keep.append(kernel_params([("u64", 1), ("u64", out.address)]))
        prev = check(driver.cuGraphAddKernelNode(graph, [prev], 1, _node_params(work, 1, 32, keep[-1])),
                     "cuGraphAddKernelNode")
        chain.append(prev)
    handles = [make_device_updatable(n) for n in chain]
    exe = check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    nodes_buf.write(b"".join(h.to_bytes(8, "little") for h in handles))
    check(driver.cuGraphUpload(exe, stream), "cuGraphUpload")
    start = check(driver.cuEventCreate(0), "cuEventCreate")
    stop = check(driver.cuEventCreate(0), "cuEventCreate")
    for _ in range(20):
        check(driver.cuGraphLaunch(exe, stream), "cuGraphLaunch")
    check(driver.cuEventRecord(start, stream), "cuEventRecord")
    for _ in range(launches):
        check(driver.cuGraphLaunch(exe, stream), "cuGraphLaunch")
    check(driver.cuEventRecord(stop, stream), "cuEventRecord")
    check(driver.cuEventSynchronize(stop), "cuEventSynchronize")
    ms = check(driver.cuEventElapsedTime(start, stop), "cuEventElapsedTime")
    for handle in (exe,):
        driver.cuGraphExecDestroy(handle)
    driver.cuGraphDestroy(graph)
    for buf in (nodes_buf, state, scratch, values, out):
        buf.close()
    driver.cuEventDestroy(start)
    driver.cuEventDestroy(stop)
    return ms * 1e3 / launches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--launches", type=int, default=300)
    args = parser.parse_args()
    check(driver.cuInit(0), "cuInit")
    dev = check(driver.cuDeviceGet(0), "cuDeviceGet")
    ctx = check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    name = check(driver.cuDeviceGetName(128, dev), "cuDeviceGetName").split(b"\0")[0].decode()
    module = check(driver.cuModuleLoadData(compile_cubin(SOURCE.read_text(), "sm_90")), "cuModuleLoadData")
    stream = check(driver.cuStreamCreate(0), "cuStreamCreate")
    result = {"machine": name, "command": "python3 bench/patch_variants.py --out $OUT",
              "what": "us per graph launch, head kernel + a chain of N tiny kernels, grid and "
                      "an int64 parameter of every node changed on every launch",
              "us_per_launch": {}}
    print(f"{'variant':26s} " + " ".join(f"{'N=' + str(c):>9s}" for c in (16, 48, 96)))
    for variant in VARIANTS:
        row = {str(c): run_variant(module, variant, c, stream, args.launches) for c in (16, 48, 96)}
        result["us_per_launch"][variant] = row
        print(f"{variant:26s} " + " ".join(f"{row[str(c)]:9.1f}" for c in (16, 48, 96)), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "patch_variants.json").write_text(json.dumps(result, indent=2))
    driver.cuStreamDestroy(stream)
    driver.cuModuleUnload(module)
    driver.cuDevicePrimaryCtxRelease(dev)


if __name__ == "__main__":
    main()
