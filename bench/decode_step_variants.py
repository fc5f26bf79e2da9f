"""GPT-2's decode step (Hugging Face, 124M, fp32, batch 1) built several ways, timed side by side
in one process: which part of a build change moves the step.

Each ``--variant NAME=ARTIFACT`` is a ``gpt2_decode`` artifact of ``bench/export_hf.py``'s
export (``bench/gpu/build_artifacts.py``'s ``decode_variants`` step builds them); all are bound
to the same weights (``--weights``: the ``gpt2_decode.weights.json`` they were built with,
recreated here from config and seed) and run on the same inputs. At each past length the
variants take turns, ``--rounds`` times ``--reps`` synchronized steps each; the median step
is reported, with each variant's ratio to the first. The outputs of every variant are
compared with the first's.

    python3 bench/decode_step_variants.py --weights build/gpu/gpt2_decode.weights.json \\
        --variant default=build/gpu/gpt2_decode.cuda.grape \\
        --variant sequential=build/gpu/sequential_launch/gpt2_decode.cuda.grape --out OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from export_hf import hf_weights  # noqa: E402  pylint: disable=wrong-import-position

PAST = (1, 64, 256, 512, 1023)


def _inputs(tvm, dev, signature, past: int, seed: int) -> dict:
    """Random token and KV cache at ``past`` for the artifact's inputs that are not bound."""
    rng = np.random.default_rng(seed)
    vocab = int(signature.outputs[0].shape[-1])  # the logits' last dim
    feeds = {}
    for spec in signature.inputs:
        if spec.name == "input_ids":
            feeds[spec.name] = tvm.runtime.tensor(np.array([[rng.integers(0, vocab)]], np.int64),
                                                  dev)
        elif spec.name.startswith("past_"):
            heads, head_dim = (int(d) for d in spec.shape[1:2] + spec.shape[3:4])
            feeds[spec.name] = tvm.runtime.tensor(
                (0.5 * rng.standard_normal((1, heads, past, head_dim))).astype(spec.dtype), dev)
    return feeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", required=True, help="NAME=ARTIFACT")
    parser.add_argument("--weights", type=Path, required=True)
    parser.add_argument("--past", default=",".join(map(str, PAST)))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--graph-mode", default="topology", choices=("topology", "per-shape"),
                        help="grape's graphs: one per topology (default) or one per shape")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()

    import tvm  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    variants = dict(v.split("=", 1) for v in args.variant)
    executors = {name: load(path, "cuda", graph_mode=args.graph_mode)
                 for name, path in variants.items()}
    first = next(iter(executors.values()))
    dev = first.device
    weights = {k: tvm.runtime.tensor(v, dev) for k, v in hf_weights(args.weights).items()}
    for ex in executors.values():
        ex.bind_inputs({t.name: weights[t.name] for t in ex.signature.inputs if t.name in weights})
    pasts = [int(p) for p in args.past.split(",")]
    step_us: dict[str, dict[str, float]] = {name: {} for name in executors}
    max_diff: dict[str, float] = {name: 0.0 for name in executors}
    for past in pasts:
        feeds = _inputs(tvm, dev, first.signature, past, seed=past)
        reference = None
        for name, ex in executors.items():
            out = ex.run(feeds)
            logits = np.asarray(out[next(iter(out))], np.float64)
            reference = logits if reference is None else reference
            max_diff[name] = max(max_diff[name], float(np.abs(logits - reference).max()))
        times: dict[str, list[float]] = {name: [] for name in executors}
        for _ in range(args.rounds):
            for name, ex in executors.items():
                for _ in range(2):
                    ex.run(feeds, return_numpy=False)
                ex.backend.synchronize()
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    ex.run(feeds, return_numpy=False)
                    ex.backend.synchronize()
                    times[name].append((time.perf_counter() - t0) * 1e6)
        for name in executors:
            step_us[name][str(past)] = statistics.median(times[name])
        print(f"past {past:5d}: " + "  ".join(f"{n}={step_us[n][str(past)]:.1f}"
                                              for n in executors), flush=True)
    base = next(iter(executors))
    ratios = {name: {p: step_us[name][p] / step_us[base][p] for p in step_us[base]}
              for name in executors}
    print(f"\n{'variant':22s}" + "".join(f"{'L=' + str(p):>9s}" for p in pasts) + "   max |diff|")
    for name in executors:
        print(f"{name:22s}" + "".join(f"{step_us[name][str(p)]:9.1f}" for p in pasts)
              + f"   {max_diff[name]:.3g}")
    nvidia = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                             "--format=csv,noheader"], text=True, capture_output=True)
    result = {"machine": nvidia.stdout.strip(),
              "command": "python3 bench/decode_step_variants.py " + " ".join(sys.argv[1:]),
              "what": "GPT-2 124M decode step, fp32, batch 1, us (median, synchronized steps, "
                      "variants in turns)",
              "graph_mode": args.graph_mode, "variants": variants, "step_us": step_us,
              "over_first": ratios,
              "max_abs_logit_diff_vs_first": max_diff, "reps": args.reps, "rounds": args.rounds}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "decode_step_variants" + ("" if args.graph_mode == "topology" else "_per_shape")
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    for ex in executors.values():
        ex.close()


if __name__ == "__main__":
    main()
