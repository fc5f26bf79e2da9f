"""Benchmark: grape's matmuls (cuBLASLt in its graphs; its GEMV kernels) against cuBLAS and
TVM's dlight schedules, GPT-2's matmuls.

``y = x @ W``, x: (M, K), W: (K, N) as Hugging Face GPT-2 holds it (Conv1D), for (K, N) in
GPT-2 124M's five shapes and M in {1, 8, 64, 512}, fp32 and fp16. Artifacts built on the CPU
machine (``bench/gpu/build_artifacts.py``, step ``matmul``), M symbolic 1..1024:

- ``auto``: grape's default on CUDA (``matmul="auto"``): grape's GEMV kernels where M is in
  ``GEMV_ROWS`` of the weight's layout (``passes/few_rows_gemv.py``), cuBLASLt above;
  reported as ``grape_us`` and ``impl`` (``auto_nk``: the same with W as (N, K))
- ``cublaslt``: ``matmul="cublaslt"``: a cuBLASLt call captured in grape's graph at every M
  (``runtime/cublaslt.py``)
- ``gemv``: ``matmul="grape"``: grape's GEMV rule takes M <= 8, dlight's Matmul M > 8
- ``tvm_dlight``: ``matmul="tvm"``: TVM's dlight schedules alone (the baseline)
- ``gemv_nk``: ``gemv`` with W as (N, K) (``nn.Linear``'s layout, the transpose fused)
- ``cublas``: ``torch.matmul`` (TF32 off) in a CUDA graph: cuBLAS, the reference

What is timed. Each system's operation is one CUDA graph holding it alone: for grape and
dlight, the graph grape's executor captured for the call (``graph_mode="per-shape"``: the
region's kernels and nothing else; here one kernel), launched with ``cuGraphLaunch``; for
cuBLAS a ``torch.cuda.CUDAGraph`` of one ``torch.matmul``. Two clocks, CUDA events on the
stream that runs the graph, a spin kernel queued first so that the host's launches are
queued before the GPU reaches them:

- ``*_us`` (warm): 50 launches back to back, time / 50, median of 7 rounds. Weights that fit
  in L2 (50 MB) stay there between launches: for all but the LM head this is L2, not HBM.
- ``*_cold_us``: one launch after a 256 MiB write evicted L2, median of 30: HBM reads, as in
  a decode step whose other weights pass through L2 in between.

Both include the GPU's cost of starting a one-node graph; ``empty_graph_us`` is that cost
(a graph of one empty kernel, timed the same ways), reported, not subtracted. The roofline
is (weights + x + y bytes) / the device's copy bandwidth, measured here (a 1 GiB device
copy, read + write). ``bandwidth_fraction`` = roofline / grape's cold time
(``gemv_bandwidth_fraction``: the GEMV kernels'). ``topologies``: topology groups over
M = 1..1024 (each power-of-two bucket's ends and every 9th M recorded) of each grape
artifact and of one dlight artifact: launch configurations a region has over the range.

    python3 bench/matmul.py --artifacts build/gpu --out OUT_DIR [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import GPT2_MATMULS  # noqa: E402  pylint: disable=wrong-import-position

ROWS = (1, 8, 64, 512)
DTYPES = ("float32", "float16")
SYSTEMS = ("auto", "auto_nk", "cublaslt", "gemv", "tvm_dlight", "gemv_nk", "cublas")
# (name, W's layout, the artifact's system: bench/gpu/build_artifacts.py's MATMUL_SYSTEMS)
ARTIFACTS = (("auto", "kn", "auto"), ("auto_nk", "nk", "auto"), ("cublaslt", "kn", "cublaslt"),
             ("gemv", "kn", "gemv"), ("tvm_dlight", "kn", "tvm_dlight"), ("gemv_nk", "nk", "gemv"))
REGION = "grape_region_0"
FLUSH_BYTES = 256 * 2**20
SPIN_CYCLES = 4_000_000  # about 2 ms at the H200's clock: longer than queuing 50 launches


class Clock:
    """CUDA-event timing of launches on one stream (a driver ``CUstream``)."""

    def __init__(self, torch, stream_handle: int):
        from grape_tvm.runtime.cuda_driver import check, driver  # pylint: disable=import-outside-toplevel

        self.torch, self.check, self.driver = torch, check, driver
        self.handle = stream_handle
        self.stream = driver.CUstream(stream_handle)
        self.torch_stream = torch.cuda.ExternalStream(stream_handle)
        self.start = check(driver.cuEventCreate(0), "cuEventCreate")
        self.stop = check(driver.cuEventCreate(0), "cuEventCreate")
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def _elapsed_us(self) -> float:
        d, check = self.driver, self.check
        check(d.cuEventSynchronize(self.stop), "cuEventSynchronize")
        return check(d.cuEventElapsedTime(self.start, self.stop), "cuEventElapsedTime") * 1e3

    def warm(self, launch, launches: int = 50, rounds: int = 7) -> float:
        """Median over rounds of (time of ``launches`` back-to-back launches) / launches."""
        d, check, torch = self.driver, self.check, self.torch
        times = []
        for _ in range(rounds):
            with torch.cuda.stream(self.torch_stream):
                torch.cuda._sleep(SPIN_CYCLES)  # pylint: disable=protected-access
            check(d.cuEventRecord(self.start, self.stream), "cuEventRecord")
            for _ in range(launches):
                launch()
            check(d.cuEventRecord(self.stop, self.stream), "cuEventRecord")
            times.append(self._elapsed_us() / launches)
        return statistics.median(times)

    def cold(self, launch, reps: int = 30) -> float:
        """Median of single launches, each after L2 was evicted by a 256 MiB write."""
        d, check, torch = self.driver, self.check, self.torch
        times = []
        for _ in range(reps):
            with torch.cuda.stream(self.torch_stream):
                self.flush.zero_()  # ~100 us of work: the launch below is queued behind it
            check(d.cuEventRecord(self.start, self.stream), "cuEventRecord")
            launch()
            check(d.cuEventRecord(self.stop, self.stream), "cuEventRecord")
            times.append(self._elapsed_us())
        return statistics.median(times)

    def close(self) -> None:
        self.driver.cuEventDestroy(self.start)
        self.driver.cuEventDestroy(self.stop)


def torch_graph(torch, fn, stream):
    """``fn`` captured in a CUDA graph (after a warm-up on ``stream``); returns (graph, out)."""
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def copy_bandwidth(torch, clock: Clock, nbytes: int = 2**30) -> float:
    """Device copy bandwidth, bytes/s: (read + write) of a ``nbytes`` copy, warm median."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    src.fill_(1)

    def launch():
        with torch.cuda.stream(clock.torch_stream):
            dst.copy_(src)

    return 2 * nbytes / (clock.warm(launch, launches=5, rounds=5) * 1e-6)


class Artifact:
    """One artifact's executor in per-shape mode, its weight bound; the graph of the last
    call at each M is what ``launch`` replays."""

    def __init__(self, path: Path, w, torch):
        from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel
        from grape_tvm.runtime.cuda_driver import check, driver  # pylint: disable=import-outside-toplevel

        self.torch, self.check, self.driver = torch, check, driver
        self.executor = load(path, "cuda", graph_mode="per-shape", max_graphs=64)
        self.executor.bind_inputs({"w": w})

    @property
    def stream_handle(self) -> int:
        return int(self.executor.backend.stream)

    def call(self, x):
        """Run once at x's M (first sight records the graph); the output as a torch tensor."""
        y = self.executor.run({"x": x}, return_numpy=False)["y"]
        self.executor.backend.synchronize()
        return self.torch.from_dlpack(y)

    def graph(self, m: int):
        # pylint: disable-next=protected-access
        return self.executor.backend._per_shape[(REGION, (m,))]

    def launcher(self, m: int):
        """Launches of the captured graph at M = m; its pointers are the last call's."""
        graph, stream = self.graph(m), self.executor.backend.stream
        d, check = self.driver, self.check
        return lambda: check(d.cuGraphLaunch(graph.exec, stream), "cuGraphLaunch")

    def impl(self, m: int) -> str:
        """The kernels the graph at M = m launches: name, grid, block."""
        d = self.driver
        parts = []
        for node in self.graph(m).nodes:
            p = node.params
            err, name = d.cuFuncGetName(p.func)
            name = name.decode() if err == d.CUresult.CUDA_SUCCESS and name else "?"
            parts.append(f"{name} grid {p.gridDimX}x{p.gridDimY}x{p.gridDimZ} "
                         f"block {p.blockDimX}x{p.blockDimY}x{p.blockDimZ}")
        return "; ".join(parts)

    def close(self) -> None:
        self.executor.close()


def topologies(path: Path, w) -> int:
    """Topology groups of the region over M = 1..1024: each power-of-two bucket's ends and
    every 9th M recorded (all 1024 take minutes with cuBLASLt's captures)."""
    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    edges = {e for k in range(11) for e in (1 << k, (1 << k) + 1)}
    sizes = sorted({m for m in edges | set(range(1, 1025, 9)) if m <= 1024})
    executor = load(path, "cuda")
    try:
        executor.bind_inputs({"w": w})
        executor.record_all({"m": sizes}, progress=False)
        groups = executor.backend.describe()["topology_groups"]
        return sum(len(g) for g in groups.values())
    finally:
        executor.close()


def _weights(torch, k: int, n: int, dtype: str, seed: int = 0):
    """W (k, n) from a seed, made on the GPU (and its (n, k) copy for the nk artifacts)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(k, n, device="cuda", generator=gen, dtype=torch.float32) / k ** 0.5
    w = w.to(getattr(torch, dtype)).contiguous()
    return w, w.t().contiguous()


def _rel_err(torch, got, x, w) -> float:
    want = x.double() @ w.double()
    return float((got.double() - want).abs().max() / want.abs().max())


def counts(quick: bool) -> tuple[int, int, int]:
    """Warm launches per round, warm rounds, cold launches."""
    return (20, 3, 10) if quick else (50, 7, 30)


def measure_shape(torch, artifacts: Path, dtype: str, k: int, n: int, rows, bandwidth: float,
                  quick: bool) -> dict:
    tdtype = getattr(torch, dtype)
    w, w_nk = _weights(torch, k, n, dtype)
    size = torch.tensor([], dtype=tdtype).element_size()
    systems = {name: Artifact(artifacts / f"matmul_{layout}_{dtype}_{k}x{n}.{built}.cuda.grape",
                              w if layout == "kn" else w_nk, torch)
               for name, layout, built in ARTIFACTS}
    cublas_stream = torch.cuda.Stream()
    clock_of = {name: Clock(torch, a.stream_handle) for name, a in systems.items()}
    clock_of["cublas"] = Clock(torch, cublas_stream.cuda_stream)
    launches, rounds, cold_reps = counts(quick)
    out = {}
    try:
        for m in rows:
            gen = torch.Generator(device="cuda").manual_seed(1000 + m)
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.float32).to(tdtype)
            entry = {}
            for name, art in systems.items():
                y = art.call(x)  # records the graph
                y = art.call(x)  # replays it: the graph's pointers are this call's
                entry[f"{name}_max_rel_err"] = _rel_err(torch, y, x, w)
                launch = art.launcher(m)
                clock = clock_of[name]
                entry[f"{name}_us"] = clock.warm(launch, launches, rounds)
                entry[f"{name}_cold_us"] = clock.cold(launch, cold_reps)
                entry[f"{name}_impl"] = art.impl(m)
            graph, y = torch_graph(torch, lambda x=x: torch.matmul(x, w), cublas_stream)
            with torch.cuda.stream(cublas_stream):  # replays go to the current stream
                graph.replay()
                torch.cuda.synchronize()
                entry["cublas_max_rel_err"] = _rel_err(torch, y, x, w)
                entry["cublas_us"] = clock_of["cublas"].warm(graph.replay, launches, rounds)
                entry["cublas_cold_us"] = clock_of["cublas"].cold(graph.replay, cold_reps)
            del graph
            nbytes = (k * n + m * k + m * n) * size
            entry["bytes"] = nbytes
            entry["roofline_us"] = nbytes / bandwidth * 1e6
            entry["grape_us"], entry["grape_cold_us"] = entry["auto_us"], entry["auto_cold_us"]
            entry["impl"] = entry.pop("auto_impl")
            entry["bandwidth_fraction"] = entry["roofline_us"] / entry["grape_cold_us"]
            entry["gemv_bandwidth_fraction"] = entry["roofline_us"] / entry["gemv_cold_us"]
            out[f"{m}x{k}x{n}"] = entry
            print(_row(dtype, m, k, n, entry), flush=True)
    finally:
        for art in systems.values():
            art.close()
        for clock in clock_of.values():
            clock.close()
    return out


HEADER = (f"{'dtype':8s} {'M':>5s} {'K':>5s} {'N':>6s} | {'grape':>7s} {'grapeNK':>7s} "
          f"{'cuBLASLt':>8s} {'gemv':>7s} {'dlight':>7s} {'gemv_nk':>7s} {'cuBLAS':>7s} "
          f"{'roofline':>8s} | {'grape':>7s} {'grapeNK':>7s} {'cuBLASLt':>8s} {'cuBLAS':>7s} | "
          f"{'grape/cuBLAS':>12s} {'grape HBM':>9s}")


def _row(dtype: str, m: int, k: int, n: int, e: dict) -> str:
    return (f"{dtype:8s} {m:5d} {k:5d} {n:6d} | {e['auto_us']:7.2f} {e['auto_nk_us']:7.2f} "
            f"{e['cublaslt_us']:8.2f} {e['gemv_us']:7.2f} {e['tvm_dlight_us']:7.2f} "
            f"{e['gemv_nk_us']:7.2f} {e['cublas_us']:7.2f} {e['roofline_us']:8.2f} | "
            f"{e['auto_cold_us']:7.2f} {e['auto_nk_cold_us']:7.2f} {e['cublaslt_cold_us']:8.2f} "
            f"{e['cublas_cold_us']:7.2f} | {e['auto_us'] / e['cublas_us']:12.2f} "
            f"{e['bandwidth_fraction']:9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifacts", type=Path, default=Path("build/gpu"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--quick", action="store_true", help="fewer launches per measurement")
    parser.add_argument("--no-topologies", action="store_true",
                        help="skip recording every M (about a minute)")
    args = parser.parse_args()
    import torch  # pylint: disable=import-outside-toplevel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.cuda.init()
    machine = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    side = torch.cuda.Stream()
    clock = Clock(torch, side.cuda_stream)
    bandwidth = copy_bandwidth(torch, clock)

    one = torch.zeros(1, device="cuda")
    graph, _ = torch_graph(torch, lambda: one.add_(1), side)  # a graph of one tiny kernel
    with torch.cuda.stream(side):  # replays go to the current stream
        floor = {"warm": clock.warm(graph.replay), "cold": clock.cold(graph.replay)}
    clock.close()
    print(f"{machine}; device copy {bandwidth / 1e12:.2f} TB/s; empty graph {floor['warm']:.2f} us "
          f"warm, {floor['cold']:.2f} us cold")
    launches, rounds, cold_reps = counts(args.quick)
    print(f"us per call; warm: {launches} graph launches back to back; cold: L2 evicted before "
          "each")
    print(f"{'':27s} | {'warm':^44s} | {'cold':^23s} |")
    print(HEADER, flush=True)
    result = {
        "machine": machine,
        "command": "bash bench/gpu/run_all.sh (python3 bench/matmul.py "
                   f"{' '.join(sys.argv[1:])})",
        "what": "y = x @ W, W (K, N) as HF GPT-2's Conv1D (auto_nk, gemv_nk: W as (N, K)), M "
                "symbolic 1..1024 in every artifact",
        "method": (f"*_us: one CUDA graph holding the operation alone, {launches} launches back "
                   f"to back (CUDA events), per launch, median of {rounds} rounds (L2-warm); "
                   f"*_cold_us: single launches after a 256 MiB write, median of {cold_reps} "
                   "(HBM); both include the GPU's "
                   "cost of a one-node graph (empty_graph_us), not subtracted; grape (auto) "
                   "and the other artifacts: the graph grape's executor captured (per-shape "
                   "mode); cublas: "
                   "torch.matmul, TF32 off, in a torch CUDA graph; roofline_us: bytes of W, x "
                   "and y at the measured device copy bandwidth; bandwidth_fraction: "
                   "roofline_us / grape_cold_us"),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "empty_graph_us": floor,
        "dtype": {},
        "topologies": {},
    }
    for dtype in DTYPES:
        result["dtype"][dtype] = {}
        for k, n in GPT2_MATMULS:
            result["dtype"][dtype].update(measure_shape(torch, args.artifacts, dtype, k, n, ROWS,
                                                        bandwidth, args.quick))
    if not args.no_topologies:
        t0 = time.perf_counter()
        for dtype in DTYPES:
            for k, n in GPT2_MATMULS:
                w, w_nk = _weights(torch, k, n, dtype)
                # dlight's one kernel is one topology: counted once, for comparison
                baseline = (dtype, k, n) == (DTYPES[0], *GPT2_MATMULS[0])
                counted = [("kn", s) for s in ("auto", "cublaslt", "gemv")] + [("nk", "auto")]
                if baseline:
                    counted.append(("kn", "tvm_dlight"))
                for layout, system in counted:
                    name = f"matmul_{layout}_{dtype}_{k}x{n}.{system}"
                    result["topologies"][f"{name}/{REGION}"] = topologies(
                        args.artifacts / f"{name}.cuda.grape", w if layout == "kn" else w_nk)
        print(f"topologies over M = 1..1024 ({time.perf_counter() - t0:.0f} s): "
              f"{json.dumps(result['topologies'], indent=1)}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "matmul.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'matmul.json'}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
