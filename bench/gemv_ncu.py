"""grape's GEMV kernels at M = 1, as ncu measured them: HBM bytes read, kernel time, bandwidth.

Reads the CSV of ``bench/gpu/run_all.sh``'s ``ncu_gemv`` step: ncu (caches flushed before
each kernel, clocks as they are) over ``bench/kernel_profile.py --executor-steps 1`` of each
``matmul_{kn,nk}_*.gemv.cuda.grape`` in name order (C locale), one process each. A process's last kernel is
its step's GEMV (the first launch records the graph). Bandwidth is bytes read over the
kernel's time, against the device copy bandwidth ``bench/matmul.py`` measured (about 4.2
TB/s on the H200) and against ncu's own peak (``dram__throughput``).

    python3 bench/gemv_ncu.py OUT/gemv_ncu.csv --copy-tbps 4.2 --out OUT
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import GPT2_MATMULS  # noqa: E402  pylint: disable=wrong-import-position


def read_kernels(csv_path: Path) -> dict[str, list[dict]]:
    """ncu's rows, one dict of metrics per kernel, grouped by process id (in launch order)."""
    lines = [line for line in csv_path.read_text().splitlines() if line.startswith('"')]
    kernels: dict[tuple, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        key = (row["Process ID"], int(row["ID"]))
        kernel = kernels.setdefault(key, {"name": row["Kernel Name"]})
        kernel[row["Metric Name"]] = (float(row["Metric Value"].replace(",", "")),
                                      row["Metric Unit"])
    by_process: dict[str, list[dict]] = {}
    for (pid, _), kernel in sorted(kernels.items(), key=lambda kv: (int(kv[0][0]), kv[0][1])):
        by_process.setdefault(pid, []).append(kernel)
    return by_process


def _seconds(value: tuple[float, str]) -> float:
    scale = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3,
             "s": 1.0, "second": 1.0}
    return value[0] * scale[value[1]]


def _bytes(value: tuple[float, str]) -> float:
    scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    return value[0] * scale[value[1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--copy-tbps", type=float, required=True,
                        help="the device copy bandwidth measured on the same machine")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    # The names build_artifacts.py gives them, in the order the shell's glob ran them.
    names = sorted(f"matmul_{layout}_{dtype}_{k}x{n}.gemv.cuda.grape" for layout in ("kn", "nk")
                   for dtype in ("float32", "float16") for k, n in GPT2_MATMULS)
    processes = list(read_kernels(args.csv).values())
    if len(processes) != len(names):
        raise SystemExit(f"{args.csv}: {len(processes)} profiled processes for {len(names)} "
                         "artifacts: cannot tell which is which")
    result = {"what": __doc__.split("\n\n", maxsplit=1)[0], "copy_tbps": args.copy_tbps,
              "csv": str(args.csv), "kernels": {}}
    print(f"{'artifact (M = 1)':40s} {'us':>7s} {'MB read':>8s} {'TB/s':>6s} "
          f"{'of copy':>8s} {'ncu peak %':>10s}")
    for name, kernels in zip(names, processes):
        last = kernels[-1]
        seconds = _seconds(last["gpu__time_duration.sum"])
        nbytes = _bytes(last["dram__bytes_read.sum"])
        tbps = nbytes / seconds / 1e12
        entry = {"kernel": last["name"], "us": seconds * 1e6, "bytes_read": nbytes,
                 "tbps": tbps, "fraction_of_copy_bandwidth": tbps / args.copy_tbps,
                 "ncu_dram_pct_of_peak": last["dram__throughput.avg.pct_of_peak_sustained_elapsed"][0]}
        result["kernels"][name] = entry
        print(f"{name:40s} {entry['us']:7.2f} {nbytes / 1e6:8.2f} {tbps:6.2f} "
              f"{entry['fraction_of_copy_bandwidth']:8.2f} {entry['ncu_dram_pct_of_peak']:10.1f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemv_ncu.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
