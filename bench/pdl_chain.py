"""What programmatic dependent launch buys a decode step's chain of small kernels, and what a
GEMV must do before its wait to gain from it (the probe behind ``ProgrammaticDependentLaunch``).

Runs ``bench/kernels/pdl_chain.cu`` (built by ``bench/gpu/build_artifacts.py``'s ``pdl_chain``
step into ``build/gpu/pdl_chain``): twelve GPT-2-sized MLP layers at M = 1, fp32, each a
layer norm, a GEMV 768 -> 3072, a GELU and a GEMV 3072 -> 768 with weights of its own (226
MB, beyond L2), in one CUDA graph; and the two GEMVs alone. Variants: kernels launched
plainly; with programmatic dependent launch, each kernel waiting first; and with a GEMV
asking L2 for its weights (a bulk prefetch, or each 128-byte line into L2 or L1), or
loading them into registers, before its wait. Every variant's output is compared with the
plain one's. Prints a table (us per layer, and the share of the 4.27 TB/s copy bandwidth
the layer's weights are read at) and writes ``pdl_chain.json``.

    python3 bench/pdl_chain.py --binary build/gpu/pdl_chain --out OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

COPY_TBPS = 4.27  # a device copy on the H200 (bench/README.md)


def run(binary: Path, reps: int, repeats: int) -> dict:
    """``repeats`` runs of the probe; per chain and variant, the median us per layer."""
    runs = [json.loads(subprocess.run([str(binary), str(reps)], check=True, text=True,
                                      capture_output=True).stdout) for _ in range(repeats)]
    first = runs[0]
    chains = {}
    for chain, variants in first["chains"].items():
        chains[chain] = {}
        for variant in variants:
            times = [r["chains"][chain][variant]["us_per_layer"] for r in runs]
            diffs = [r["chains"][chain][variant]["max_abs_diff"] for r in runs]
            chains[chain][variant] = {"us_per_layer": statistics.median(times),
                                      "runs_us": times, "max_abs_diff": max(diffs)}
    weight_bytes = first["weight_bytes_per_layer"]
    for variants in chains.values():
        plain = variants["plain"]["us_per_layer"]
        for found in variants.values():
            found["over_plain"] = found["us_per_layer"] / plain
            found["fraction_of_copy_bandwidth"] = weight_bytes / (found["us_per_layer"] * 1e-6) \
                / (COPY_TBPS * 1e12)
    return {"layers": first["layers"], "weight_bytes_per_layer": weight_bytes,
            "reps": reps, "repeats": repeats, "copy_tbps": COPY_TBPS, "chains": chains}


def print_table(result: dict) -> None:
    for chain, variants in result["chains"].items():
        print(f"\n{chain} ({result['weight_bytes_per_layer'] / 1e6:.1f} MB of weights a layer)")
        print(f"  {'variant':10s} {'us/layer':>9s} {'/ plain':>8s} {'of copy BW':>11s} "
              f"{'max diff':>9s}")
        for variant, found in variants.items():
            print(f"  {variant:10s} {found['us_per_layer']:9.3f} {found['over_plain']:8.3f} "
                  f"{found['fraction_of_copy_bandwidth']:11.1%} {found['max_abs_diff']:9.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--binary", type=Path, default=Path("build/gpu/pdl_chain"))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--reps", type=int, default=200, help="graph launches timed per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the probe")
    args = parser.parse_args()
    result = run(args.binary, args.reps, args.repeats)
    nvidia = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                             "--format=csv,noheader"], text=True, capture_output=True)
    result["machine"] = nvidia.stdout.strip()
    result["command"] = ("bash bench/gpu/run_all.sh (python3 bench/pdl_chain.py --binary "
                         "build/gpu/pdl_chain --out $OUT)")
    print_table(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pdl_chain.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
