"""grape's GEMV kernels as a decode step runs them: many in one graph, each reading its
weights from HBM, at M = 1 and 8, against cuBLAS on the same weights in the same run.

Artifacts (``bench/gpu/build_artifacts.py``'s ``gemv_chain`` step, ``build/gpu/gemv_chain``):

- ``{dtype}_{K}x{N}``: ``models.gemv_chain_relax``, ``y_i = x @ W_i + b_i`` for each of
  GPT-2 124M's layer shapes (K, N), with enough layers that the weights (``CHAIN_BYTES``,
  150 MB) are three times the H200's L2: each kernel reads its weight from HBM.
- ``mlp_{dtype}``: ``models.mlp_chain_relax``, GPT-2's MLP (GEMV 768 -> 3072 with bias and
  GELU, GEMV 3072 -> 768 with bias and residual) repeated, each layer reading the last.
- each also under ``sequential/``, built with ``dependent_launch=False``: every kernel
  launched once the one before it has finished (system ``grape_sequential``); under any
  other folder, another build of it (system ``grape_FOLDER``: ``ptxas_default``, without
  a minimum of blocks an SM for the kernels that hold their weights across the wait;
  ``one_block``, a minimum of one). ``--per-shape``: the default build also in one graph
  per shape (system ``grape_per_shape``: no device-updatable nodes, no patch kernel).

Weights are ``main``'s parameters, bound once (as a model's are): grape stores them [N, K]
and its GEMV kernels load their share into registers before waiting on the kernel before
(``passes/dependent_launch.py``). They are made here from a seed. cuBLAS runs the same chain
(``F.linear`` on the weights stored [N, K], TF32 off) captured in one
``torch.cuda.CUDAGraph``. What is timed: ``--reps`` calls queued back to back between CUDA
events on the stream that runs them (grape: its executor's calls, one topology graph each;
cuBLAS: graph replays), the median of ``--rounds`` rounds, the systems taking turns. Per
call: ``gpu_us``; per kernel, ``us_per_gemv`` = ``gpu_us`` / GEMVs in the chain; and
``fraction_of_copy_bandwidth``: the weights' and biases' bytes over ``gpu_us``, as a share of
the H200's 4.27 TB/s device copy. ``host_us``: grape's host time per queued call (the GPU
does not wait on it when it is below ``gpu_us``). Outputs are compared with PyTorch's in
fp32 (``max_rel_error``: the largest absolute error over the largest absolute reference).

    python3 bench/gemv_chain.py --dir build/gpu/gemv_chain --out OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

COPY_TBPS = 4.27  # a device copy on the H200 (bench/README.md)
ROWS = (1, 8)


def chain_weights(signature, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights for every input but ``x``, scaled as a layer's (1 / sqrt(K))."""
    rng = np.random.default_rng(seed)
    weights = {}
    for spec in signature.inputs:
        if spec.name == "x":
            continue
        shape = tuple(int(d) for d in spec.shape)
        scale = 1.0 / np.sqrt(shape[0]) if len(shape) == 2 else 0.1
        weights[spec.name] = (scale * rng.standard_normal(shape, np.float32)).astype(spec.dtype)
    return weights


def torch_chain(kind: str, weights: dict):
    """The chain in PyTorch: ``fn(x)`` returning the outputs grape's artifact returns."""
    import torch  # pylint: disable=import-outside-toplevel
    import torch.nn.functional as F  # pylint: disable=import-outside-toplevel

    on_gpu = {k: torch.from_numpy(v).cuda() for k, v in weights.items()}
    if kind == "mlp":
        layers = len([k for k in on_gpu if k.startswith("w1_")])
        ws = [(on_gpu[f"w1_{i}"].t().contiguous(), on_gpu[f"b1_{i}"],
               on_gpu[f"w2_{i}"].t().contiguous(), on_gpu[f"b2_{i}"]) for i in range(layers)]

        def mlp(x):
            for w1, b1, w2, b2 in ws:
                x = F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2) + x
            return [x]
        return mlp
    layers = len([k for k in on_gpu if re.fullmatch(r"w\d+", k)])
    ws = [(on_gpu[f"w{i}"].t().contiguous(), on_gpu[f"b{i}"]) for i in range(layers)]
    return lambda x: [F.linear(x, w, b) for w, b in ws]


class CudaEvents:
    """A start and a stop event on one stream: GPU microseconds between them."""

    def __init__(self):
        from grape_tvm.runtime.cuda_driver import check, driver  # pylint: disable=import-outside-toplevel

        self.check, self.driver = check, driver
        self.start = check(driver.cuEventCreate(0), "cuEventCreate")
        self.stop = check(driver.cuEventCreate(0), "cuEventCreate")

    def time(self, stream, work) -> float:
        self.check(self.driver.cuEventRecord(self.start, stream), "cuEventRecord")
        work()
        self.check(self.driver.cuEventRecord(self.stop, stream), "cuEventRecord")
        self.check(self.driver.cuEventSynchronize(self.stop), "cuEventSynchronize")
        return self.check(self.driver.cuEventElapsedTime(self.start, self.stop),
                          "cuEventElapsedTime") * 1e3

    def close(self) -> None:
        self.driver.cuEventDestroy(self.start)
        self.driver.cuEventDestroy(self.stop)


def measure_chain(name: str, artifacts: dict[str, tuple[Path, str]], rows: list[int],
                  reps: int, rounds: int) -> dict[str, dict]:
    """One chain at each of ``rows``: each system's GPU time per call, the outputs checked.
    ``artifacts``: each grape system's artifact and graph mode. Loaded and bound once."""
    import torch  # pylint: disable=import-outside-toplevel
    import tvm  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    executors = {system: load(path, "cuda", graph_mode=mode)
                 for system, (path, mode) in artifacts.items()}
    signature = executors["grape"].signature
    weights = chain_weights(signature)
    bound = {k: tvm.runtime.tensor(v, executors["grape"].device) for k, v in weights.items()}
    for ex in executors.values():
        ex.bind_inputs(bound)
    kind = "mlp" if name.startswith("mlp") else "gemv"
    torch.backends.cuda.matmul.allow_tf32 = False
    chains = {"reference": torch_chain(kind, {k: v.astype(np.float32) for k, v in weights.items()}),
              "cublas": torch_chain(kind, weights)}
    chain = {"gemvs": sum(1 for s in signature.inputs if len(s.shape) == 2 and s.name != "x"),
             "weight_bytes": int(sum(v.nbytes for v in weights.values()))}
    found = {str(m): {**chain, "systems": _measure_rows(executors, chains, chain, m, reps, rounds)}
             for m in rows}
    for ex in executors.values():
        ex.close()
    torch.cuda.empty_cache()
    return found


def _measure_rows(executors: dict, chains: dict, chain: dict, rows: int, reps: int,
                  rounds: int) -> dict[str, dict]:
    """Every system at ``rows``: grape's executors and PyTorch's chain (``chains``: fp32
    reference and cuBLAS's in the chain's dtype), timed in turns."""
    import torch  # pylint: disable=import-outside-toplevel
    import tvm  # pylint: disable=import-outside-toplevel

    first = next(iter(executors.values()))
    spec = first.signature.inputs[0]
    rng = np.random.default_rng(rows)
    x_np = rng.standard_normal((rows, int(spec.shape[1]))).astype(spec.dtype)
    feeds = {"x": tvm.runtime.tensor(x_np, first.device)}
    reference = [r.double().cpu().numpy()
                 for r in chains["reference"](torch.from_numpy(x_np.astype(np.float32)).cuda())]
    largest = max(float(np.abs(r).max()) for r in reference)

    def error(outputs) -> float:
        return max(float(np.abs(np.asarray(g, np.float64) - r).max())
                   for g, r in zip(outputs, reference)) / largest

    errors = {system: error(ex.run(feeds).values()) for system, ex in executors.items()}
    x_torch = torch.from_numpy(x_np).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):
            chains["cublas"](x_torch)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        torch_out = chains["cublas"](x_torch)
    graph.replay()
    torch.cuda.synchronize()
    errors["cublas"] = error(t.double().cpu().numpy() for t in torch_out)

    events = CudaEvents()
    times = {system: [] for system in [*executors, "cublas"]}
    host = {system: [] for system in executors}
    torch_stream = events.driver.CUstream(torch.cuda.current_stream().cuda_stream)
    for _ in range(rounds):
        for system, ex in executors.items():
            for _ in range(2):
                ex.run(feeds, return_numpy=False)
            ex.backend.synchronize()

            def calls(ex=ex, system=system):
                t0 = time.perf_counter()
                for _ in range(reps):
                    ex.run(feeds, return_numpy=False)
                host[system].append((time.perf_counter() - t0) * 1e6 / reps)
            times[system].append(events.time(ex.backend.stream, calls) / reps)
        graph.replay()
        torch.cuda.synchronize()
        times["cublas"].append(events.time(torch_stream, lambda g=graph: [
            g.replay() for _ in range(reps)]) / reps)
    events.close()
    systems = {}
    for system, found in times.items():
        gpu_us = statistics.median(found)
        systems[system] = {"gpu_us": gpu_us, "us_per_gemv": gpu_us / chain["gemvs"],
                           "fraction_of_copy_bandwidth": chain["weight_bytes"] / (gpu_us * 1e-6)
                           / (COPY_TBPS * 1e12),
                           "max_rel_error": errors[system], "rounds_us": found}
        if system in host:
            systems[system]["host_us"] = statistics.median(host[system])
    return systems


def print_table(results: dict) -> None:
    systems = list(dict.fromkeys(s for by_rows in results.values() for found in by_rows.values()
                                 for s in found["systems"]))
    print(f"\n{'chain':18s} {'M':>2s} {'GEMVs':>5s} {'MB':>6s}  "
          + "  ".join(f"{s + ' us/GEMV':>24s} {'BW':>5s}" for s in systems) + "  max rel err")
    for name, by_rows in results.items():
        for rows, found in by_rows.items():
            cells = []
            for system in systems:
                entry = found["systems"].get(system)
                cells.append(f"{entry['us_per_gemv']:24.2f} "
                             f"{entry['fraction_of_copy_bandwidth']:5.0%}"
                             if entry else f"{'-':>24s} {'-':>5s}")
            worst = max(e["max_rel_error"] for e in found["systems"].values())
            print(f"{name:18s} {rows:>2s} {found['gemvs']:5d} {found['weight_bytes'] / 1e6:6.1f}  "
                  + "  ".join(cells) + f"  {worst:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("build/gpu/gemv_chain"))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--reps", type=int, default=50, help="calls queued per timing")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-shape", action="store_true",
                        help="also the default build in one graph per shape (grape_per_shape)")
    parser.add_argument("--json", default="gemv_chain", help="the results file's name")
    args = parser.parse_args()
    results = {}
    for path in sorted(args.dir.glob("*.cuda.grape")):
        name = path.name.removesuffix(".cuda.grape")
        artifacts = {"grape": (path, "topology")}
        for other in sorted(p for p in args.dir.iterdir() if (p / path.name).exists()):
            artifacts[f"grape_{other.name}"] = (other / path.name, "topology")
        if args.per_shape:
            artifacts["grape_per_shape"] = (path, "per-shape")
        results[name] = measure_chain(name, artifacts, [int(r) for r in args.rows.split(",")],
                                      args.reps, args.rounds)
        for rows, found in results[name].items():
            print(f"{name} M={rows}: " + "  ".join(
                f"{s} {e['us_per_gemv']:.2f} us/GEMV ({e['fraction_of_copy_bandwidth']:.0%})"
                for s, e in found["systems"].items()), flush=True)
    print_table(results)
    nvidia = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                             "--format=csv,noheader"], text=True, capture_output=True)
    document = {"machine": nvidia.stdout.strip(),
                "command": "python3 bench/gemv_chain.py " + " ".join(sys.argv[1:]),
                "what": __doc__.split("\n\n")[0].replace("\n", " "),
                "copy_tbps": COPY_TBPS, "reps": args.reps, "rounds": args.rounds,
                "chains": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.json}.json").write_text(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()
