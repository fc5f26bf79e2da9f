"""Benchmark: process memory over many executors and many shapes (host RSS; on CUDA also
the device memory in use).

Two workloads on the bundled example (``examples/blocks.onnx``, n declared 1..SHAPES):

- ``load_run_close``: ``CYCLES`` times: load the artifact, run it at one n twice (VM path,
  then planned), close it. Nothing may accumulate.
- ``distinct_shapes``: one executor, ``SHAPES`` calls, each at an n not seen before (the
  worst case: every call is recorded), against TVM's VM alone on the same shapes.

Growth is measured from after a warm-up (the first load and call: TVM's and the
allocator's one-time costs) to the end, with the default bounds (``max_shapes``).

    python3 bench/memory.py --out OUT_DIR [--device cuda --artifact blocks.cuda.grape]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

WIDTH = 64  # the example's width


def rss_mib() -> float:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def device_used_mib(device: str) -> float | None:
    if device != "cuda":
        return None
    from cuda.bindings import driver  # pylint: disable=import-outside-toplevel

    _, free, total = driver.cuMemGetInfo()
    return (total - free) / 2**20


class Meter:
    """Host RSS and device memory now, against a baseline taken by ``start``."""

    def __init__(self, device: str):
        self.device = device
        self.host = self.dev = 0.0

    def start(self) -> None:
        gc.collect()
        self.host, self.dev = rss_mib(), device_used_mib(self.device) or 0.0

    def growth(self) -> dict:
        gc.collect()
        used = device_used_mib(self.device)
        return {"host_mib": round(rss_mib() - self.host, 1),
                "device_mib": None if used is None else round(used - self.dev, 1)}


def compile_example(path: Path, hi: int, target: str) -> None:
    import onnx  # pylint: disable=import-outside-toplevel

    import grape_tvm  # pylint: disable=import-outside-toplevel
    from blocks import make_blocks  # pylint: disable=import-outside-toplevel

    model = path.with_suffix(".onnx")
    onnx.save(make_blocks(), str(model))
    grape_tvm.compile_onnx(model, dims={"n": (1, hi)}, target=target).export(path)


def _sample(samples: list, entry: dict) -> None:
    samples.append(entry)
    print(", ".join(f"{k} {v}" for k, v in entry.items()), flush=True)


def load_run_close(path: Path, device: str, cycles: int, samples: list) -> dict:
    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    x = np.random.default_rng(0).standard_normal((16, WIDTH)).astype(np.float32)

    def cycle():
        executor = load(path, device)
        executor.run({"x": x})
        executor.run({"x": x})
        executor.close()

    cycle()
    meter = Meter(device)
    meter.start()
    start = time.perf_counter()
    for i in range(cycles):
        cycle()
        if (i + 1) % max(cycles // 10, 1) == 0:
            _sample(samples, {"workload": "load_run_close", "count": i + 1, **meter.growth()})
    return {**meter.growth(), "cycles": cycles, "seconds": round(time.perf_counter() - start, 1)}


def distinct_shapes(path: Path, device: str, shapes: int, samples: list, system: str) -> dict:
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm.runtime.vm import VirtualMachine  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load, load_library  # pylint: disable=import-outside-toplevel

    rows = np.random.default_rng(1).standard_normal((shapes, WIDTH)).astype(np.float32)
    if system == "grape":
        executor = load(path, device)
        call = lambda x: executor.run({"x": x})["y"]  # noqa: E731
    else:
        library, _, dev = load_library(path, device)
        vm = VirtualMachine(library, dev)
        call = lambda x: vm["main"](tvm.runtime.tensor(x, dev)).numpy()  # noqa: E731
    call(rows[:1])
    meter = Meter(device)
    meter.start()
    start = time.perf_counter()
    order = np.random.default_rng(2).permutation(np.arange(2, shapes + 1))
    for i, n in enumerate(order):
        call(rows[:n])
        if (i + 1) % max(len(order) // 10, 1) == 0:
            _sample(samples, {"workload": f"distinct_shapes/{system}", "count": i + 1,
                              **meter.growth()})
    result = {**meter.growth(), "shapes": int(len(order)) + 1,
              "seconds": round(time.perf_counter() - start, 1)}
    if system == "grape":
        result["plans_held"] = executor.stats.plans_held
        result["shapes_held"] = executor.stats.shapes_held
        executor.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--artifact", type=Path, default=None,
                        help="a compiled blocks example whose n range covers --shapes "
                             "(default: compiled here for llvm)")
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--shapes", type=int, default=10000)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    path = args.artifact
    if path is None:
        path = args.out / "memory_blocks.llvm.grape"
        args.out.mkdir(parents=True, exist_ok=True)
        compile_example(path, args.shapes, "llvm")
    samples: list = []
    result = {
        "machine": f"{platform.node()}, {platform.processor() or platform.machine()}, "
                   f"{os.cpu_count()} cores",
        "command": "python3 bench/memory.py " + " ".join(sys.argv[1:]),
        "device": args.device,
        "load_run_close": load_run_close(path, args.device, args.cycles, samples),
        "distinct_shapes": {system: distinct_shapes(path, args.device, args.shapes, samples, system)
                            for system in ("grape", "tvm_vm")},
        "samples": samples,
    }
    print(f"{'workload':<28} {'host MiB':>9} {'device MiB':>11} {'seconds':>8}")
    rows = [("load_run_close x%d" % args.cycles, result["load_run_close"])] + [
        (f"{args.shapes} shapes, {system}", r) for system, r in result["distinct_shapes"].items()]
    for label, r in rows:
        dev = "-" if r["device_mib"] is None else f"{r['device_mib']:.1f}"
        print(f"{label:<28} {r['host_mib']:>9.1f} {dev:>11} {r['seconds']:>8.1f}")
    args.out.mkdir(parents=True, exist_ok=True)
    name = "memory.json" if args.device == "cpu" else f"memory_{args.device}.json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    if args.artifact is None:
        path.unlink()
        path.with_suffix(".onnx").unlink()


if __name__ == "__main__":
    main()
