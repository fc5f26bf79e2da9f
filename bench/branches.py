"""Benchmark: a data-dependent branch with and without a host read of its condition.

``models.branch_model`` (width 512, fp32): ``h = gelu(x @ w_in)``; if ``mean(h) >
threshold`` three more layers, else one. The threshold alternates so that the branch
taken changes on every call. Systems, on the same inputs:

- ``tvm_vm``: TVM's VM on TVM's build (its pipeline, grape's tolerant schedule rules): the
  VM copies the condition to the host and launches the branch's kernels one by one
- ``grape_host_if``: grape with the ``if`` left to the VM (``device_branches=False``): the
  condition read on the host, each branch's kernels one graph
- ``grape``: the ``if`` as a conditional region: both branches' graphs launch, the patch
  kernel disables the one not taken; no host read, so calls queue back to back

Two timings per system and n: ``synced_us`` (a sync after every call: latency) and
``queued_us`` (calls queued back to back, one sync at the end: what a caller that does not
need the result at once sees; a host read forces a sync inside every call anyway).

    python3 bench/branches.py --artifacts build/gpu --out OUT_DIR
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

from models import BRANCH_WEIGHTS, branch_weights  # noqa: E402  pylint: disable=wrong-import-position

WIDTH = 512
SIZES = [1, 16, 128, 1024]
THRESHOLDS = (-10.0, 10.0)  # then, else


class System:
    """One way of running the model: ``call(x, threshold)`` returns the output tensor."""

    def __init__(self, name: str, call, sync):
        self.name, self.call, self.sync = name, call, sync


def systems(artifacts: Path) -> tuple[list[System], dict]:
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm.runtime.vm import VirtualMachine  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load, load_library  # pylint: disable=import-outside-toplevel

    weights = branch_weights(WIDTH)
    found = []
    executors = {}
    for name in ("grape", "grape_host_if"):
        executor = load(artifacts / f"branches.{name}.cuda.grape", "cuda")
        dev = executor.device
        executor.bind_inputs({k: tvm.runtime.tensor(v, dev) for k, v in weights.items()})
        executors[name] = executor
        found.append(System(name, lambda x, t, e=executor: e.run({"x": x, "threshold": t},
                                                                 return_numpy=False)["y"],
                            executor.backend.synchronize))
    library, _, dev = load_library(artifacts / "branches.tvm_vm.cuda.grape", "cuda")
    vm = VirtualMachine(library, dev)
    on_device = [tvm.runtime.tensor(weights[k], dev) for k in BRANCH_WEIGHTS]
    found.insert(0, System("tvm_vm", lambda x, t: vm["main"](x, *on_device, t),
                           lambda: dev.sync()))
    return found, executors


def measure(system: System, inputs: list, repeats: int) -> dict:
    for x, t in inputs:  # first sight of each dims and branch: recorded here
        system.call(x, t)
    system.sync()
    synced = []
    for _ in range(repeats):
        for x, t in inputs:
            start = time.perf_counter()
            system.call(x, t)
            system.sync()
            synced.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(repeats):
        for x, t in inputs:
            system.call(x, t)
    system.sync()
    queued = (time.perf_counter() - start) / (repeats * len(inputs))
    return {"synced_us": 1e6 * statistics.median(synced), "queued_us": 1e6 * queued}


def check(found: list[System], inputs: list) -> float:
    """Largest difference of each system from TVM's VM on every input."""
    worst = 0.0
    for x, t in inputs:
        want = found[0].call(x, t).numpy()
        for system in found[1:]:
            worst = max(worst, float(np.abs(system.call(x, t).numpy() - want).max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifacts", type=Path, default=Path("build/gpu"))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    import torch  # pylint: disable=import-outside-toplevel
    import tvm  # pylint: disable=import-outside-toplevel

    found, executors = systems(args.artifacts)
    dev = executors["grape"].device
    rng = np.random.default_rng(0)
    result = {"machine": f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}",
              "command": "python3 bench/branches.py " + " ".join(sys.argv[1:]),
              "model": f"branch_model(width={WIDTH}): then 3 layers, else 1; branch flips every call",
              "step_us": {s.name: {} for s in found}}
    worst = 0.0
    for n in SIZES:
        x = tvm.runtime.tensor(rng.standard_normal((n, WIDTH)).astype(np.float32), dev)
        inputs = [(x, tvm.runtime.tensor(np.array(t, np.float32), dev)) for t in THRESHOLDS]
        worst = max(worst, check(found, inputs))
        for system in found:
            result["step_us"][system.name][str(n)] = measure(system, inputs, args.repeats)
    result["max_abs_diff_vs_tvm_vm"] = worst
    # The VM systems read the condition once per call by construction; grape's guards are
    # read on the device unless its backend had to fall back to reading them on the host.
    result["grape_guards_read_on_host"] = executors["grape"].backend.describe()["synchronizing_guards"]
    # grape's calls where the VM ran the conditional, reading the condition (while a branch
    # was not yet recorded at that n); tvm_vm and grape_host_if read it on every call.
    result["grape_host_branch_reads"] = executors["grape"].stats.host_branch_reads
    result["grape_calls"] = executors["grape"].stats.calls
    print(f"max |system - TVM VM| = {worst:.2e}")
    print(f"{'n':>6} " + " ".join(f"{s.name + ' synced/queued us':>32}" for s in found))
    for n in SIZES:
        cells = [result["step_us"][s.name][str(n)] for s in found]
        print(f"{n:>6} " + " ".join(f"{c['synced_us']:>15.1f} / {c['queued_us']:>14.1f}" for c in cells))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "branches.json").write_text(json.dumps(result, indent=1))
    for executor in executors.values():
        executor.close()


if __name__ == "__main__":
    main()
