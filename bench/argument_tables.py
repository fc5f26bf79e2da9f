"""Benchmark: one CUDA graph per topology against every other way to run a dynamic model.

Model: 24 blocks of ``x + gelu(layer_norm(x) @ W + b)``, width 768, fp32, n = 1..1024 (built
on the CPU machine by ``bench/gpu/build_artifacts.py``; weights made here from a seed).
Systems, all on device-resident inputs, each call synchronized:

- ``grape``: grape-tvm, one graph per topology, argument tables applied on the device
- ``graph_per_shape``: grape-tvm in per-shape mode (one instantiated graph per n)
- ``tvm_vm``: TVM's VM, TVM's default CUDA pipeline
- ``tvm_cuda_graph``: the same with ``relax.backend.use_cuda_graph``
- ``torch_eager``, ``torch_graph_per_shape``: PyTorch, eager and one ``CUDAGraph`` per n

Also: ``gpu_busy_us``, the same kernels at the same n replayed back to back in one plain
graph (CUDA events); grape's host overhead per call, beside PyTorch's graph replay's;
device memory to serve every n (free memory before and after recording all shapes); cold
start; grape against TVM's VM at every n.

    python3 bench/argument_tables.py --artifacts build/gpu --out OUT_DIR [--quick]
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

from models import block_weight_names, block_weights  # noqa: E402  pylint: disable=wrong-import-position

WIDTH, DEPTH, HI = 768, 24, 1024
SYSTEMS = ["grape", "graph_per_shape", "tvm_vm", "tvm_cuda_graph", "torch_eager",
           "torch_graph_per_shape"]


def _ns(quick: bool) -> list[int]:
    ns = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    return ns if not quick else [1, 16, 256, 1024]


class Harness:
    """Every system, ready to be called at a given n on device-resident inputs."""

    def __init__(self, artifacts: Path):
        import torch  # pylint: disable=import-outside-toplevel
        import tvm  # pylint: disable=import-outside-toplevel
        from tvm.runtime.vm import VirtualMachine  # pylint: disable=import-outside-toplevel

        from grape_tvm.loader import load, load_library  # pylint: disable=import-outside-toplevel

        self.torch, self.tvm = torch, tvm
        self.weights_np = block_weights(WIDTH, DEPTH)
        grape_path = artifacts / "blocks24.grape.cuda.grape"
        self.grape = load(grape_path, "cuda")
        self.per_shape = load(grape_path, "cuda", graph_mode="per-shape", max_graphs=2048)
        self.dev = self.grape.device
        self.w_tvm = {k: tvm.runtime.tensor(v, self.dev) for k, v in self.weights_np.items()}
        for ex in (self.grape, self.per_shape):
            ex.bind_inputs(self.w_tvm)  # weights once; calls pass only x
        self.order = block_weight_names(DEPTH)
        self.vms = {}
        for name in ("tvm_vm", "tvm_cuda_graph"):
            library, _, dev = load_library(artifacts / f"blocks24.{name}.cuda.grape", "cuda")
            self.vms[name] = VirtualMachine(library, dev)
        self.w_torch = {k: torch.from_numpy(v).cuda() for k, v in self.weights_np.items()}
        self.torch_graphs: dict[int, tuple] = {}
        self.x_tvm: dict[int, object] = {}
        self.x_torch: dict[int, object] = {}

    # -- inputs --------------------------------------------------------------------------
    def inputs(self, n: int):
        if n not in self.x_tvm:
            x = np.random.default_rng(n).standard_normal((n, WIDTH)).astype(np.float32)
            self.x_tvm[n] = self.tvm.runtime.tensor(x, self.dev)
            self.x_torch[n] = self.torch.from_numpy(x).cuda()
        return self.x_tvm[n], self.x_torch[n]

    # -- systems -------------------------------------------------------------------------
    def torch_model(self, h):
        F = self.torch.nn.functional
        w = self.w_torch
        for i in range(DEPTH):
            ln = F.layer_norm(h, (WIDTH,), w[f"ln_g{i}"], w[f"ln_b{i}"], 1e-5)
            h = h + F.gelu(ln @ w[f"w{i}"] + w[f"b{i}"])
        return h

    def call(self, system: str, n: int):
        x_tvm, x_torch = self.inputs(n)
        if system in ("grape", "graph_per_shape"):
            ex = self.grape if system == "grape" else self.per_shape
            out = ex.run({"x": x_tvm}, return_numpy=False)["y"]
            ex.backend.synchronize()
            return out
        if system in self.vms:
            out = self.vms[system]["main"](x_tvm, *[self.w_tvm[k] for k in self.order])
            self.dev.sync()
            return out
        if system == "torch_eager":
            with self.torch.no_grad():
                out = self.torch_model(x_torch)
            self.torch.cuda.synchronize()
            return out
        graph, static_x, static_y = self._torch_graph(n)
        static_x.copy_(x_torch)  # the placeholder copy plain CUDA graphs need
        graph.replay()
        self.torch.cuda.synchronize()
        return static_y

    def _torch_graph(self, n: int):
        if n not in self.torch_graphs:
            torch = self.torch
            static_x = self.x_torch[n].clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(2):
                    self.torch_model(static_x)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), torch.no_grad():
                static_y = self.torch_model(static_x)
            self.torch_graphs[n] = (graph, static_x, static_y)
        return self.torch_graphs[n]


def measure_latency(h: Harness, ns: list[int], reps: int) -> dict:
    """Median microseconds per call; n changes on every call, in random order."""
    rng = np.random.default_rng(0)
    sequence = [n for n in ns for _ in range(reps)]
    out = {}
    for system in SYSTEMS:
        for n in ns:  # first sight (capture) is cold start, not latency
            h.call(system, n)
        times: dict[int, list[float]] = {n: [] for n in ns}
        for n in rng.permutation(sequence):
            t0 = time.perf_counter()
            h.call(system, int(n))
            times[int(n)].append((time.perf_counter() - t0) * 1e6)
        out[system] = {str(n): statistics.median(v) for n, v in times.items()}
        print(f"  {system:22s} " + " ".join(f"{out[system][str(n)]:8.0f}" for n in ns), flush=True)
    return out


def measure_gpu_busy(h: Harness, ns: list[int], launches: int = 50) -> dict:
    """The floor: the same kernels at the same n, one plain graph replayed back to back."""
    from grape_tvm.runtime.cuda_driver import check, driver  # pylint: disable=import-outside-toplevel

    backend = h.per_shape.backend
    start = check(driver.cuEventCreate(0), "cuEventCreate")
    stop = check(driver.cuEventCreate(0), "cuEventCreate")
    out = {}
    for n in ns:
        h.call("graph_per_shape", n)
        graph = backend._per_shape[("grape_region_0", (n,))]  # pylint: disable=protected-access
        check(driver.cuGraphLaunch(graph.exec, backend.stream), "cuGraphLaunch")
        check(driver.cuEventRecord(start, backend.stream), "cuEventRecord")
        for _ in range(launches):
            check(driver.cuGraphLaunch(graph.exec, backend.stream), "cuGraphLaunch")
        check(driver.cuEventRecord(stop, backend.stream), "cuEventRecord")
        check(driver.cuEventSynchronize(stop), "cuEventSynchronize")
        ms = check(driver.cuEventElapsedTime(start, stop), "cuEventElapsedTime")
        out[str(n)] = ms * 1e3 / launches
    driver.cuEventDestroy(start)
    driver.cuEventDestroy(stop)
    return out


def measure_host_overhead(h: Harness, ns: list[int], calls: int = 200) -> dict:
    """Microseconds from a call's entry to the return of its launch (no sync), with a sync
    before each call, each call's n drawn at random, in turns of 25 calls: grape with calls
    repeating an earlier call's inputs made again from what it kept (``ready``), grape with
    ``GraphExecutor.keep_ready_calls`` off (``no_ready``: every call plans and writes its
    launch records), and PyTorch's ``CUDAGraph.replay()`` of the graph captured at that n
    (``torch_replay``: its placeholder already holding the input, so no copy). The last is
    the reference the host goal is set against: hosts differ up to 2x between leases, so
    the ratio to it is what compares across runs."""
    rng = np.random.default_rng(1)
    arms = ("ready", "no_ready", "torch_replay")
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    phases: dict[str, dict[str, list[float]]] = {arm: {} for arm in arms}
    for n in ns:  # captured before timing
        h._torch_graph(n)  # pylint: disable=protected-access
    for turn in range(len(arms) * calls // 25):
        arm = arms[turn % len(arms)]
        h.grape.keep_ready_calls = arm == "ready"
        h.torch.cuda.synchronize()  # the turn before's last launch done, whoever made it
        for n in rng.choice(ns, size=25):
            times[arm].append(_host_us_of_one_call(h, arm, int(n)))
            if arm != "torch_replay":
                for phase, us in h.grape.stats.last_host_us.items():
                    phases[arm].setdefault(phase, []).append(us)
    h.grape.keep_ready_calls = True
    h.grape.backend.synchronize()
    h.torch.cuda.synchronize()
    _profile_host(h, ns)
    return {arm: {"median": statistics.median(times[arm]),
                  "p90": float(np.percentile(times[arm], 90)),
                  "phases": {phase: statistics.median(v) for phase, v in phases[arm].items()}}
            for arm in arms}


def _host_us_of_one_call(h: Harness, arm: str, n: int) -> float:
    """One call's host microseconds, the device idle before it."""
    if arm == "torch_replay":
        graph = h._torch_graph(n)[0]  # pylint: disable=protected-access
        h.torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        return (time.perf_counter() - t0) * 1e6
    x_tvm, _ = h.inputs(n)
    h.grape.backend.synchronize()
    t0 = time.perf_counter()
    h.grape.run({"x": x_tvm}, return_numpy=False)
    return (time.perf_counter() - t0) * 1e6


def measure_queued(h: Harness, ns: list[int], calls: int = 300) -> dict:
    """Calls queued back to back with no sync, one n at a time: whether the GPU waits on
    the host. ``gpu_busy_over_wall`` = the kernels' GPU-busy time (the floor, per call)
    times the calls, over the GPU time from the first call's start to the last's end."""
    from grape_tvm.runtime.cuda_driver import check, driver  # pylint: disable=import-outside-toplevel

    busy = measure_gpu_busy(h, ns)
    stream = h.grape.backend.stream
    start = check(driver.cuEventCreate(0), "cuEventCreate")
    stop = check(driver.cuEventCreate(0), "cuEventCreate")
    out = {}
    try:
        for n in ns:
            x_tvm, _ = h.inputs(n)
            h.grape.run({"x": x_tvm}, return_numpy=False)
            h.grape.backend.synchronize()
            check(driver.cuEventRecord(start, stream), "cuEventRecord")
            t0 = time.perf_counter()
            for _ in range(calls):
                h.grape.run({"x": x_tvm}, return_numpy=False)
            host = (time.perf_counter() - t0) * 1e6 / calls
            check(driver.cuEventRecord(stop, stream), "cuEventRecord")
            check(driver.cuEventSynchronize(stop), "cuEventSynchronize")
            wall = check(driver.cuEventElapsedTime(start, stop), "cuEventElapsedTime") * 1e3
            out[str(n)] = {"gpu_busy_over_wall": busy[str(n)] * calls / wall,
                           "gpu_us_per_call": wall / calls, "host_us_per_call": host,
                           "gpu_busy_us": busy[str(n)]}
            print(f"  queued n={n:5d}: GPU {wall / calls:7.1f} us/call, host {host:6.1f} "
                  f"us/call, GPU-busy/wall {out[str(n)]['gpu_busy_over_wall']:.3f}", flush=True)
    finally:
        driver.cuEventDestroy(start)
        driver.cuEventDestroy(stop)
    return out


def _profile_host(h: Harness, ns: list[int], calls: int = 200) -> None:
    """Where grape's host time goes (printed to the log, for the next optimization)."""
    import cProfile  # pylint: disable=import-outside-toplevel
    import io  # pylint: disable=import-outside-toplevel
    import pstats  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(3)
    profile = cProfile.Profile()
    for n in rng.choice(ns, size=calls):
        x_tvm, _ = h.inputs(int(n))
        h.grape.backend.synchronize()
        profile.enable()
        h.grape.run({"x": x_tvm}, return_numpy=False)
        profile.disable()
    h.grape.backend.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
    print(f"host profile of {calls} grape calls:\n" + text.getvalue(), flush=True)


def measure_memory_and_cold_start(artifacts: Path, h: Harness) -> tuple[dict, dict, dict]:
    """Device memory of graphs and tables, and time, to record every n, in both modes.

    Memory is the drop in free device memory across each graph instantiation, upload and
    table write (``CudaGraphBackend.graph_device_bytes``): the VM's own buffers, which both
    modes share, are left out.
    """
    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    memory, cold, detail = {}, {}, {}
    for system, mode in (("grape", "topology"), ("graph_per_shape", "per-shape")):
        ex = load(artifacts / "blocks24.grape.cuda.grape", "cuda", graph_mode=mode, max_graphs=2048)
        ex.bind_inputs(h.w_tvm)
        cold[system] = ex.record_all()
        ex.backend.synchronize()
        memory[system] = int(ex.backend.graph_device_bytes)
        detail[system] = ex.backend.describe()
        if mode == "per-shape":
            detail[system]["bytes_per_graph"] = memory[system] / max(ex.backend.graphs_instantiated, 1)
        ex.close()
    return memory, cold, detail


def _table_bytes(grape_backend: dict) -> dict:
    """Argument tables of every shape: full (grid and every parameter byte of every node,
    per shape: what per-shape graphs repeat) against compressed (base once, then the varying
    columns of each shape), and what grape holds on the device for them."""
    groups = [g for region in grape_backend["topology_groups"].values() for g in region]
    return {"full": sum(g["table_bytes_uncompressed"] for g in groups),
            "compressed": sum(g["table_bytes_compressed"] for g in groups),
            "device_buffers": sum(g["graph_table_device_bytes"] for g in groups),
            "groups": len(groups), "shapes": sum(g["shapes"] for g in groups),
            "columns": [g["columns"] for g in groups], "nodes": [g["nodes"] for g in groups]}


def max_error_every_n(h: Harness) -> float:
    """grape against TVM's VM at every n of the range, in random order."""
    worst = 0.0
    for n in np.random.default_rng(2).permutation(np.arange(1, HI + 1)):
        a = h.call("grape", int(n)).numpy()  # copied out before the next call reuses it
        b = h.call("tvm_vm", int(n)).numpy()
        worst = max(worst, float(np.abs(a - b).max()))
    return worst


def plot(result: dict, path: Path) -> None:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    fig, ax = plt.subplots(figsize=(8, 5))
    for system, series in result["latency_us"].items():
        ns = sorted(int(n) for n in series)
        ax.plot(ns, [series[str(n)] for n in ns], marker="o", ms=3, label=system)
    busy = result["gpu_busy_us"]
    ns = sorted(int(n) for n in busy)
    ax.plot(ns, [busy[str(n)] for n in ns], "k--", label="GPU busy (floor)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("n (rows; changes on every call)")
    ax.set_ylabel("latency per call (us)")
    ax.set_title(f"{result['model']} on {result['machine'].split(',')[0]}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifacts", type=Path, default=Path("build/gpu"))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch  # pylint: disable=import-outside-toplevel

    machine = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    h = Harness(args.artifacts)
    ns = _ns(args.quick)
    print(f"latency (us, median of {args.reps} calls per n, n random per call)\n"
          f"  {'n':22s} " + " ".join(f"{n:8d}" for n in ns), flush=True)
    latency = measure_latency(h, ns, args.reps)
    busy = measure_gpu_busy(h, ns)
    print(f"  {'gpu_busy (floor)':22s} " + " ".join(f"{busy[str(n)]:8.0f}" for n in ns))
    hosts = measure_host_overhead(h, ns)
    host = hosts["ready"]
    for key, figures in hosts.items():
        print(f"host us per call ({key}): median {figures['median']:.1f}, p90 "
              f"{figures['p90']:.1f}; median by phase: "
              + (", ".join(f"{k} {v:.1f}" for k, v in figures["phases"].items()) or "-"),
              flush=True)
    queued = measure_queued(h, [n for n in (1, 16, 256) if n in ns])
    err = max_error_every_n(h)
    memory, cold, detail = measure_memory_and_cold_start(args.artifacts, h)
    result = {
        "machine": machine,
        "command": "bash bench/gpu/run_all.sh (python3 bench/argument_tables.py "
                   f"{' '.join(sys.argv[1:])})",
        "model": f"{DEPTH} blocks x + gelu(layer_norm(x) @ W + b), width {WIDTH}, fp32, n = 1..{HI}",
        "latency_us": latency,
        "gpu_busy_us": busy,
        "host_overhead_us": {"grape": host["median"], "grape_p90": host["p90"],
                             "grape_no_ready": hosts["no_ready"]["median"],
                             "grape_no_ready_p90": hosts["no_ready"]["p90"],
                             "torch_graph_replay": hosts["torch_replay"]["median"],
                             "torch_graph_replay_p90": hosts["torch_replay"]["p90"]},
        "host_phases_us": host["phases"],
        "host_phases_no_ready_us": hosts["no_ready"]["phases"],
        "queued": queued,
        "graph_memory_bytes": memory,
        "cold_start_s": cold,
        "max_abs_err": err,
        "table_bytes": _table_bytes(detail["grape"]),
        "max_abs_err_what": f"grape vs TVM's VM (default pipeline), every n in 1..{HI}",
        "backend": detail,
        "ratios": {
            "host_grape_over_torch_graph_replay": host["median"] / hosts["torch_replay"]["median"],
            "grape_over_gpu_busy": {n: latency["grape"][n] / busy[n] for n in busy},
            "tvm_vm_over_grape": {n: latency["tvm_vm"][n] / latency["grape"][n] for n in busy},
            "graph_memory_per_shape_over_grape": memory["graph_per_shape"] / max(memory["grape"], 1),
        },
    }
    (args.out / "argument_tables.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "argument_tables.png")
    print(json.dumps({k: result[k] for k in ("host_overhead_us", "host_phases_us", "graph_memory_bytes",
                                             "cold_start_s", "max_abs_err", "ratios")}, indent=1))
    for ex in (h.grape, h.per_shape):
        ex.close()


if __name__ == "__main__":
    main()
