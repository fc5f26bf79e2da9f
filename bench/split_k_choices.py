"""Where grape's cuBLASLt choice differs from the heuristic's first: split-K parts too fine.

For the matmuls of GPT-2 (fp32, fp16) and of the decode-loop benchmark's decoders (fp32),
at the upper end of every bucket of M (1 to 1024), asks ``runtime.cublaslt.CublasLt`` for
its plan and records the heuristic's first candidate beside the one taken
(``CublasLt._sensible``: the first whose split-K parts each sum ``MIN_K_PER_SPLIT`` of K, or
the first with its split-K capped).
No timing: it says which problems the rule changes.

    python3 bench/split_k_choices.py --out OUT

Prints the problems whose choice changed and writes ``split_k_choices.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import DECODER_BENCH, DECODER_SMALL, GPT2_MATMULS  # noqa: E402  pylint: disable=wrong-import-position

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def decoder_matmuls(config: dict) -> list[tuple[int, int]]:
    hidden = config["hidden"]
    return [(hidden, 3 * hidden), (hidden, hidden), (hidden, 4 * hidden), (4 * hidden, hidden),
            (hidden, config["vocab"])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    from grape_tvm.runtime import cublaslt  # pylint: disable=import-outside-toplevel

    lt = cublaslt.CublasLt(0)
    seen: list[dict] = []
    sensible = lt._sensible  # pylint: disable=protected-access

    def recorded(desc, candidates, function, dtype, problem):
        chosen = sensible(desc, candidates, function, dtype, problem)
        def algo(found):
            return lt._algo_config(found, cublaslt._ALGO_CONFIG_ID)  # pylint: disable=protected-access

        first, split = candidates[0], lt._split_k  # pylint: disable=protected-access
        seen.append({"first_algo": algo(first), "first_split_k": split(first),
                     "chosen_algo": algo(chosen), "chosen_split_k": split(chosen),
                     "candidates": len(candidates)})
        seen[-1]["changed"] = (seen[-1]["first_algo"], seen[-1]["first_split_k"]) != \
            (seen[-1]["chosen_algo"], seen[-1]["chosen_split_k"])
        return chosen

    lt._sensible = recorded  # pylint: disable=protected-access
    problems = [("gpt2", dtype, k, n) for dtype in ("float32", "float16") for k, n in GPT2_MATMULS]
    problems += [(name, "float32", k, n) for name, config in (("decoder", DECODER_BENCH),
                                                              ("decoder_small", DECODER_SMALL))
                 for k, n in decoder_matmuls(config)]
    rows = []
    for model, dtype, k, n in problems:
        for function_name in ("grape.cublaslt.matmul_bias", "grape.cublaslt.matmul_bias_residual"):
            function = cublaslt.MATMUL_FUNCTIONS[function_name]
            for m in BUCKETS:
                seen.clear()
                plan = lt._choose(function, dtype, cublaslt._Problem(m, k, n), None)  # pylint: disable=protected-access
                lt._release(plan)  # pylint: disable=protected-access
                row = {"model": model, "function": function_name, "dtype": dtype, "m": m,
                       "k": k, "n": n, **seen[-1]}
                rows.append(row)
                if row["changed"]:
                    print(f"{model:14s} {function_name:38s} {dtype:8s} M<={m:<5d} K={k:<5d} N={n:<6d}"
                          f" first: algo {row['first_algo']} split-K {row['first_split_k']}"
                          f" -> algo {row['chosen_algo']} split-K {row['chosen_split_k']}", flush=True)
    changed = sum(r["changed"] for r in rows)
    print(f"{changed} of {len(rows)} choices differ from the heuristic's first")
    lt.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "split_k_choices.json").write_text(json.dumps({
        "what": __doc__.split("\n\n", maxsplit=1)[0], "min_k_per_split": cublaslt.MIN_K_PER_SPLIT,
        "changed": changed, "problems": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
