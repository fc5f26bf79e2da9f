"""A data-dependent early exit as a conditional region: no host read of the condition.

    python examples/early_exit.py                       # build and run on the CPU
    python examples/early_exit.py --device cuda --artifact build/gpu/branches.grape.cuda.grape

The model (``bench/models.py:branch_model``, width 256 here): ``h = gelu(x @ w_in)``; if
``mean(h) > threshold``, three more layers, else one. It is compiled with every ``if`` as a
conditional region (``select_ops=0``), run at several sizes on both branches, and checked
against numpy. On a GPU host pass an artifact built on the CPU machine (``make
gpu-artifacts``: width 512): there, both branches' graphs launch and the patch kernel of
each reads the condition on the device.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from models import branch_model, branch_numpy, branch_weights  # noqa: E402  pylint: disable=wrong-import-position

import grape_tvm  # noqa: E402  pylint: disable=wrong-import-position


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--artifact", type=Path, default=None,
                        help="a built artifact (else one is built here, for the CPU)")
    args = parser.parse_args()
    path = args.artifact
    if path is None:
        module = grape_tvm.build(branch_model(256), {"n": (1, 64)}, "llvm", select_ops=0,
                                 output_names=["y"])
        path = module.export(Path(__file__).resolve().parent / "early_exit.llvm.grape")
        print(f"built {path}: {len(module.plan['conditionals'])} conditional region(s), "
              f"{len(module.plan['host_steps'])} host step(s)")
    executor = grape_tvm.load(path, args.device)
    width = int(executor.signature.inputs[0].shape[1])
    weights = branch_weights(width)
    executor.bind_inputs(weights)
    rng = np.random.default_rng(0)
    worst = 0.0
    for n in (1, 9, 33, 9, 1):
        x = rng.standard_normal((n, width)).astype(np.float32)
        for threshold in (-10.0, 10.0):  # three layers, then one
            got = executor.run({"x": x, "threshold": np.array(threshold, np.float32)})["y"]
            worst = max(worst, float(np.abs(got - branch_numpy(x, weights, threshold)).max()))
            launches = executor.stats.last["graph_launches"]  # region launches, both branches
            print(f"n={n:3d} threshold={threshold:+.0f}: {executor.stats.last['path']:8s}"
                  f" {launches} region launches")
    print(f"max |grape - numpy| = {worst:.2e}; {executor.stats.planned_calls} of "
          f"{executor.stats.calls} calls without the VM (from the compiled call program); "
          f"the condition read on the host {executor.stats.host_branch_reads} time(s)")
    executor.close()
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
