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
one step) and sums the last launch's kernels by name and launch configuration: time, share
of the step and, where ncu measured DRAM bytes, the bytes and the time over their bound at
the copy bandwidth (``--copy-tbps``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


# ncu's units, to microseconds and bytes
_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
          "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}
TIME = "gpu__time_duration.sum"
BYTES = ("dram__bytes_read.sum", "dram__bytes_write.sum")


def ncu_kernels(csv_path: Path) -> list[dict]:
    """One dict per profiled kernel (in launch order) from ncu's CSV: name, block, grid,
    and each metric in microseconds or bytes."""
    import csv  # pylint: disable=import-outside-toplevel
    import io  # pylint: disable=import-outside-toplevel

    lines = [line for line in csv_path.read_text().splitlines() if line.startswith('"')]
    kernels: dict[tuple, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        kernel = kernels.setdefault((row["Process ID"], row["ID"]), {
            "name": row["Kernel Name"].split("(")[0][:100], "block": row["Block Size"],
            "grid": row["Grid Size"]})
        value = float(row["Metric Value"].replace(",", ""))
        kernel[row["Metric Name"]] = value * _UNITS.get(row.get("Metric Unit", ""), 1.0)
    return list(kernels.values())


def ncu_summary(csv_path: Path, json_path: Path | None, top: int, copy_tbps: float) -> None:
    """The last graph launch's kernels from ncu's CSV, summed by name and launch shape: time,
    DRAM bytes (where ncu measured them) and the time over their bound at ``copy_tbps``."""
    import json  # pylint: disable=import-outside-toplevel

    kernels = ncu_kernels(csv_path)
    step = kernels[len(kernels) // 2:]  # two launches of one graph: the second is the step
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for kernel in step:
        groups[(kernel["name"], kernel["block"], kernel["grid"])].append(kernel)
    total = sum(k[TIME] for k in step)
    summary = []
    for (name, block, grid), calls in groups.items():
        us = sum(k[TIME] for k in calls)
        entry = {"name": name, "block": block, "grid": grid, "calls": len(calls), "us": us,
                 "share": us / total}
        measured = [m for m in BYTES if m in calls[0]]
        if measured:
            moved = sum(k[m] for k in calls for m in measured)
            bound = moved / (copy_tbps * 1e12) * 1e6
            entry.update(bytes=moved, bound_us=bound, over_bound=us / bound if bound else None)
        summary.append(entry)
    summary.sort(key=lambda e: -e["us"])
    print(f"{len(step)} kernels, {total:.1f} us of GPU time (ncu, each kernel alone)")
    for e in summary[:top]:
        moved = (f"  {e['bytes'] / 1e6:8.2f} MB  {e['over_bound']:6.1f}x bound"
                 if e.get("over_bound") else "")
        print(f"  {e['us']:8.1f} us {e['share']:6.1%} {e['calls']:4d} x "
              f"{e['us'] / e['calls']:6.2f}{moved}  block {e['block']} grid {e['grid']}  "
              f"{e['name']}")
    if json_path is not None:
        json_path.write_text(json.dumps({
            "source": str(csv_path), "kernels": len(step), "total_us": total,
            "copy_tbps": copy_tbps,
            "what": "us: ncu's gpu__time_duration of each kernel alone; bytes: DRAM bytes "
                    "read and written; bound_us: bytes at the device copy bandwidth; "
                    "over_bound: us / bound_us; share: of the step's kernel time",
            "by_kernel": summary}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path, nargs="?")
    parser.add_argument("--ncu-summary", type=Path, help="ncu's CSV of an --executor-steps run")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--copy-tbps", type=float, default=4.25,
                        help="the bandwidth bound, TB/s (bench/results/matmul.json measures it)")
    parser.add_argument("--dim", action="append", default=[], help="NAME=VALUE")
    parser.add_argument("--weights", type=Path, help="a weights.json of bench/export_hf.py")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--executor-steps", type=int, default=0)
    parser.add_argument("--graph-mode", default="topology",
                        help="per-shape for ncu: it cannot profile device-updatable nodes")
    parser.add_argument("--log-memsets", action="store_true",
                        help="with --executor-steps in topology mode: print each library "
                             "memset the backend turns into a grape_fill kernel")
    parser.add_argument("--patch-staged-bytes", type=int, default=None,
                        help="the patch kernel's shared-memory budget (0: it stages nothing, "
                             "as before staging existed): an A/B of its time under ncu")
    args = parser.parse_args()
    if args.patch_staged_bytes is not None:
        from grape_tvm.runtime import topology_graph  # pylint: disable=import-outside-toplevel

        topology_graph.STAGED_BYTES = args.patch_staged_bytes
    if args.ncu_summary is not None:
        ncu_summary(args.ncu_summary, args.json, args.top, args.copy_tbps)
        return
    if args.artifact is None:
        parser.error("an artifact is needed (or --ncu-summary)")

    import tvm  # pylint: disable=import-outside-toplevel
    from tvm.runtime.vm import VirtualMachine, VMInstrumentReturnKind  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import entry_argument, load_library  # pylint: disable=import-outside-toplevel
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
    # Weights the build reads transposed (plan["transposed_inputs"]): bound by the executor,
    # which transposes them; the VM takes them as the build does.
    transposed = set(manifest["plan"].get("transposed_inputs", ()))
    if args.executor_steps:
        if args.log_memsets:
            _log_memsets()
        _executor_steps(args.artifact, signature, inputs, args.executor_steps,
                        set(weights) | transposed, args.graph_mode)
        return
    inputs = [entry_argument(manifest, spec.name, t, dev)
              for spec, t in zip(signature.inputs, inputs)]
    # grape's library functions (cuBLASLt, attention) for TVM's VM: a grape backend
    # registers them when it starts, and none runs here.
    from grape_tvm.runtime import attention, cublaslt  # pylint: disable=import-outside-toplevel

    cublaslt.register_functions()
    attention.register_functions()
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


def _log_memsets() -> None:
    """Print the memsets the CUDA backend turns into ``grape_fill`` kernels (topology mode):
    address, rows of width by element size, value."""
    from grape_tvm.runtime import cuda_backend  # pylint: disable=import-outside-toplevel

    convert = cuda_backend.memsets_as_kernels

    def logged(graph, memsets, fill):
        for _, m in memsets:
            print(f"memset as grape_fill: {max(m.height, 1)} x {m.width} x {m.element_size} B "
                  f"(pitch {m.pitch}) = {max(m.height, 1) * m.width * m.element_size} B, "
                  f"value {m.value}")
        return convert(graph, memsets, fill)

    cuda_backend.memsets_as_kernels = logged


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
        described = executor.backend.describe()
        print("backend: " + ", ".join(f"{k} {described.get(k)}" for k in (
            "mode", "graphs_instantiated", "memsets_as_kernels", "graphs_not_kept")))
        for key, algorithm in (described.get("cublaslt_algorithms") or {}).items():
            print(f"  cuBLASLt {key}: {algorithm}")


if __name__ == "__main__":
    main()
