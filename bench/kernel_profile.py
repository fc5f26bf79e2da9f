"""GPU time of each kernel of an artifact at given dims, largest first.

Runs the artifact's entry function on TVM's VM with an instrument that synchronizes the
device around every kernel call: slow, but it says which kernels the time goes to.

    python3 bench/kernel_profile.py build/gpu/gpt2_decode.cuda.grape --dim batch=1 --dim past=256 \\
        [--weights build/gpu/gpt2_decode.weights.json] [--top 15]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--dim", action="append", default=[], help="NAME=VALUE")
    parser.add_argument("--weights", type=Path, help="a weights.json of bench/export_hf.py")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()

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


if __name__ == "__main__":
    main()
