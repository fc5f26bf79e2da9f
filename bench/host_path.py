"""Benchmark: where a planned call's host time goes, phase by phase (``CallStats.host_us``).

The 24-block model of ``bench/argument_tables.py`` (x + gelu(layer_norm(x) @ W + b)), built
here for the CPU (llvm, TVM's kernels replayed without the VM) unless ``--artifact`` names a
built one (``build/gpu/blocks24.grape.cuda.grape`` on the GPU host, ``--device cuda``).
Inputs live on the device; calls are not synchronized, so the figures are the host's own.
Two sequences: the same n every call (the launch record does not change), and n drawn at
random per call (a new row, a new record, each call); each input tensor is passed again
and again, so calls are made again from what an earlier call kept (``_no_ready``: with
``GraphExecutor.keep_ready_calls`` off, every call plans and writes its records). On the CPU ``driver`` is the time
in TVM's kernels themselves.

    python3 bench/host_path.py [--device cuda --artifact build/gpu/blocks24.grape.cuda.grape]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import block_weights, blocks_relax  # noqa: E402  pylint: disable=wrong-import-position

PHASES = ("checks", "plan", "record", "driver")


def _executor(args):
    import grape_tvm  # pylint: disable=import-outside-toplevel

    if args.artifact is None:
        module = grape_tvm.build(blocks_relax(args.width, args.depth), {"n": (1, 64)}, "llvm",
                                 output_names=["y"])
        args.artifact = module.export(Path(tempfile.mkdtemp(prefix="host-path-")) / "blocks.llvm.grape")
    executor = grape_tvm.load(args.artifact, args.device)
    executor.bind_inputs(block_weights(args.width, args.depth))
    return executor


def measure(executor, ns: list[int], calls: int, seed: int) -> dict:
    import tvm  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(seed)
    xs = {n: tvm.runtime.tensor(rng.standard_normal((n, executor.signature.inputs[0].shape[1]))
                                .astype(np.float32), executor.device) for n in set(ns)}
    for n in xs:  # recorded and planned before timing
        executor.run({"x": xs[n]}, return_numpy=False)
    executor.backend.synchronize()
    totals, phases = [], {p: [] for p in PHASES}
    for n in rng.choice(ns, size=calls):
        t0 = time.perf_counter()
        executor.run({"x": xs[int(n)]}, return_numpy=False)
        totals.append((time.perf_counter() - t0) * 1e6)
        for phase in PHASES:
            phases[phase].append(executor.stats.last_host_us.get(phase, 0.0))
        if len(totals) % 32 == 0:
            executor.backend.synchronize()  # bounded queue: the host, not a full queue, is timed
    executor.backend.synchronize()
    return {"total_us": {"median": statistics.median(totals),
                         "p90": float(np.percentile(totals, 90))},
            "phases_us": {p: statistics.median(v) for p, v in phases.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--artifact", type=Path, default=None)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    executor = _executor(args)
    result = {"machine": "CPU machine (2 cores)" if args.device == "cpu" else args.device,
              "command": "python3 bench/host_path.py " + " ".join(sys.argv[1:]),
              "artifact": str(args.artifact), "device": args.device,
              "backend": executor.backend.name,
              "same_n": measure(executor, [16], args.calls, 0),
              "random_n": measure(executor, [1, 2, 4, 8, 16, 32, 64], args.calls, 1)}
    executor.keep_ready_calls = False  # every call plans and writes its launch records
    result["same_n_no_ready"] = measure(executor, [16], args.calls, 0)
    result["random_n_no_ready"] = measure(executor, [1, 2, 4, 8, 16, 32, 64], args.calls, 1)
    executor.close()
    print(f"{'sequence':17s} {'median':>8s} {'p90':>8s} " + " ".join(f"{p:>8s}" for p in PHASES))
    for name in ("same_n", "random_n", "same_n_no_ready", "random_n_no_ready"):
        r = result[name]
        print(f"{name:17s} {r['total_us']['median']:8.1f} {r['total_us']['p90']:8.1f} "
              + " ".join(f"{r['phases_us'][p]:8.1f}" for p in PHASES))
    path = args.out / f"host_path_{args.device}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
