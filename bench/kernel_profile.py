"""GPU time of each kernel of an artifact at given dims, largest first.

Runs the artifact's entry function on TVM's VM with an instrument that synchronizes the
device around every kernel call: slow, but it says which kernels the time goes to.
``--executor-steps N`` instead runs grape's executor N times at those dims (one graph
launch each, no sync between), for a profiler outside (``ncu --graph-profiling node``:
every kernel node's own time, ``bench/gpu/run_all.sh``'s ``ncu_gpt2`` step).

    python3 bench/kernel_profile.py build/gpu/gpt2_decode.cuda.grape --dim batch=1 --dim past=256 \\
        [--weights build/gpu/gpt2_decode.weights.json] [--top 15] [--executor-steps 50]
    python3 bench/kernel_profile.py --ncu-summary OUT/gpt2_step_ncu.csv --json OUT.json

``--ncu-summary`` reads ncu's CSV of such a run (the graph launched twice: recording, then
one step) and sums the last launch's kernels by name and launch configuration.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def ncu_summary(csv_path: Path, json_path: Path | None, top: int) -> None:
    """The last graph launch's kernels from ncu's CSV, summed by name and launch shape."""
    import csv  # pylint: disable=import-outside-toplevel
    import io  # pylint: disable=import-outside-toplevel
    import json  # pylint: disable=import-outside-toplevel

    lines = [line for line in csv_path.read_text().splitlines() if line.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    step = rows[len(rows) // 2:]  # two launches of one graph: the second is the step
    groups: dict[tuple, list[float]] = defaultdict(list)
    for row in step:
        key = (row["Kernel Name"].split("(")[0][:100], row["Block Size"], row["Grid Size"])
        groups[key].append(float(row["Metric Value"].replace(",", "")) / 1e3)
    total = sum(sum(v) for v in groups.values())
    ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    print(f"{len(step)} kernels, {total:.1f} us of GPU time (ncu, each kernel alone)")
    for (name, block, grid), times in ranked[:top]:
        print(f"  {sum(times):8.1f} us {len(times):4d} x {sum(times) / len(times):6.2f}  "
              f"block {block} grid {grid}  {name}")
    if json_path is not None:
        json_path.write_text(json.dumps({
            "source": str(csv_path), "kernels": len(step), "total_us": total,
            "by_kernel": [{"name": n, "block": b, "grid": g, "calls": len(t), "us": sum(t)}
                          for (n, b, g), t in ranked]}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path, nargs="?")
    parser.add_argument("--ncu-summary", type=Path, help="ncu's CSV of an --executor-steps run")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--dim", action="append", default=[], help="NAME=VALUE")
    parser.add_argument("--weights", type=Path, help="a weights.json of bench/export_hf.py")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--executor-steps", type=int, default=0)
    parser.add_argument("--graph-mode", default="topology",
                        help="per-shape for ncu: it cannot profile device-updatable nodes")
    parser.add_argument("--patch-staged-bytes", type=int, default=None,
                        help="the patch kernel's shared-memory budget (0: it stages nothing, "
                             "as before staging existed): an A/B of its time under ncu")
    args = parser.parse_args()
    if args.patch_staged_bytes is not None:
        from grape_tvm.runtime import topology_graph  # pylint: disable=import-outside-toplevel

        topology_graph.STAGED_BYTES = args.patch_staged_bytes
    if args.ncu_summary is not None:
        ncu_summary(args.ncu_summary, args.json, args.top)
        return
    if args.artifact is None:
        parser.error("an artifact is needed (or --ncu-summary)")

    import tvm  # pylint: disable=import-outside-toplevel
    from tvm.runtime.vm import VirtualMachine, VMInstrumentReturnKind  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load_library  # pylint: disable=import-outside-toplevel
    from grape_tvm.runtime.signature import Signature  # pylint: disable=import-outside-toplevel

    library, manifest, dev = load_library(args.artifact, "cuda")
    signature = Signature.from_json(manifest["signature"])
    dims = {k: int(v) for k, v in (d.split("=") for d in args.dim)}
    weights = {}
    if args.weights:
        from export_hf import hf_weights  # pylint: disable=import-outside-toplevel

        weights = hf_weights(args.weights)
    inputs = []
    for spec in signature.inputs:
        if spec.name in weights:
            inputs.append(tvm.runtime.tensor(weights[spec.name], dev))
            continue
        shape = tuple(d if isinstance(d, int) else dims[d] for d in spec.shape)
        inputs.append(tvm.runtime.tensor(np.zeros(shape, spec.dtype), dev))
    if args.executor_steps:
        _executor_steps(args.artifact, signature, inputs, args.executor_steps, set(weights),
                        args.graph_mode)
        return
    vm = VirtualMachine(library, dev)
    times: dict[str, list[float]] = defaultdict(list)
    started: list[float] = []

    def instrument(_func, symbol, before_run, _ret, *_args):
        if symbol.startswith("vm.builtin.") or symbol.startswith("grape_region"):
            return VMInstrumentReturnKind.NO_OP
        dev.sync()
        if before_run:
            started.append(time.perf_counter())
        else:
            times[symbol].append(time.perf_counter() - started.pop())
        return VMInstrumentReturnKind.NO_OP

    vm["main"](*inputs)  # warm: loads modules
    dev.sync()
    vm.set_instrument(instrument)
    vm["main"](*inputs)
    total = sum(sum(v) for v in times.values())
    print(f"{args.artifact.name} at {dims}: {sum(len(v) for v in times.values())} kernel calls, "
          f"{total * 1e6:.0f} us (each synchronized: includes ~10 us of launch and sync)")
    ranked = sorted(times.items(), key=lambda kv: -sum(kv[1]))
    for symbol, spans in ranked[:args.top]:
        print(f"  {sum(spans) * 1e6:9.0f} us  {len(spans):4d} calls  {symbol}")


def _executor_steps(artifact: Path, signature, inputs: list, steps: int,
                    weight_names: set[str], graph_mode: str) -> None:
    """grape's executor at these dims, ``steps`` times after a first (recording) call."""
    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    with load(artifact, "cuda", graph_mode=graph_mode) as executor:
        named = {spec.name: tensor for spec, tensor in zip(signature.inputs, inputs)}
        executor.bind_inputs({k: v for k, v in named.items() if k in weight_names})
        feeds = {k: v for k, v in named.items() if k not in executor.bound_names}
        executor.run(feeds, return_numpy=False)
        executor.backend.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            executor.run(feeds, return_numpy=False)
        executor.backend.synchronize()
        print(f"{steps} executor calls: {(time.perf_counter() - start) / steps * 1e6:.0f} us "
              f"each; {executor.stats}")


if __name__ == "__main__":
    main()
