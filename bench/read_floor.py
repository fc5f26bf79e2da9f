"""How fast can a kernel read a GEMV's weights at all: the floor under grape's GEMV at M = 1.

A GEMV at M = 1 reads its weights once; at GPT-2's layer sizes (1.2 to 9.4 MB) a kernel's
launch and the first loads' DRAM latency are a large part of its time, so the fraction of
copy bandwidth it can reach depends on the size. This measures, under ncu with caches
flushed before each kernel (as ``bench/gemv_ncu.py``'s grape GEMVs are measured):

- ``read_floor``: a plain read of the same bytes (``bench/kernels/read_floor.cu``), over a
  sweep of grids and loads in flight per thread, the fastest kept;
- ``cublas``: PyTorch's ``F.linear`` at M = 1 (cuBLAS), weights ``[N, K]``, TF32 off.

    ncu --cache-control all --clock-control none --metrics gpu__time_duration.sum,\\
        dram__bytes_read.sum --csv --log-file OUT/read_floor_ncu.csv \\
        python3 bench/read_floor.py launch --cubin build/gpu/read_floor.cubin --out OUT
    python3 bench/read_floor.py summary --ncu OUT/read_floor_ncu.csv \\
        --gemv OUT/gemv_ncu.json --out OUT

``launch`` writes ``read_floor_items.json`` (what was launched, in order: a marker kernel
before each item); ``summary`` joins it with ncu's CSV and grape's GEMV times (``gemv_ncu.json``
of the same run), prints a table and writes ``read_floor.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_profile import TIME, ncu_kernels  # noqa: E402  pylint: disable=wrong-import-position
from models import GPT2_MATMULS  # noqa: E402  pylint: disable=wrong-import-position

DTYPES = {"float32": 4, "float16": 2}
UNROLLS = (1, 2, 4, 8)
# (threads per block, blocks per SM): at most 2048 threads resident per SM on sm_90
GRIDS = ((256, 1), (256, 2), (256, 4), (256, 8), (512, 1), (512, 2), (512, 4), (1024, 1),
         (1024, 2))
MARK = "read_floor_mark"


def shapes():
    for dtype in DTYPES:
        for k, n in GPT2_MATMULS:
            yield dtype, k, n


def launch(args) -> int:
    import torch  # pylint: disable=import-outside-toplevel
    from cuda.bindings import driver  # pylint: disable=import-outside-toplevel

    from grape_tvm.runtime.cuda_compile import kernel_params  # pylint: disable=import-outside-toplevel
    from grape_tvm.runtime.cuda_driver import check  # pylint: disable=import-outside-toplevel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.zeros(1, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    module = check(driver.cuModuleLoadData(args.cubin.read_bytes()), "cuModuleLoadData")
    kernels = {u: check(driver.cuModuleGetFunction(module, f"read_floor_u{u}".encode()),
                        "cuModuleGetFunction") for u in UNROLLS}
    mark = check(driver.cuModuleGetFunction(module, MARK.encode()), "cuModuleGetFunction")
    largest = max(k * n * DTYPES[d] for d, k, n in shapes())
    data = torch.randint(0, 1 << 30, (largest // 4,), dtype=torch.int32, device="cuda")
    sink = torch.zeros(4, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream

    def run(function, blocks, threads, storage=None):
        params = 0 if storage is None else ctypes.addressof(storage[1])
        check(driver.cuLaunchKernel(function, blocks, 1, 1, threads, 1, 1, 0, stream, params, 0),
              "cuLaunchKernel")

    items = []
    for dtype, k, n in shapes():
        nbytes = k * n * DTYPES[dtype]
        weight = torch.randn(n, k, device="cuda").to(getattr(torch, dtype))
        x = torch.randn(1, k, device="cuda").to(getattr(torch, dtype))
        torch.nn.functional.linear(x, weight)  # cuBLAS's handle and workspace, outside
        torch.cuda.synchronize()
        run(mark, 1, 32)
        torch.nn.functional.linear(x, weight)
        items.append({"what": "cublas", "dtype": dtype, "k": k, "n": n, "bytes": nbytes})
        for unroll in UNROLLS:
            for threads, per_sm in GRIDS:
                storage = kernel_params([("u64", data.data_ptr()), ("u64", nbytes // 16),
                                         ("u64", sink.data_ptr())])
                run(mark, 1, 32)
                run(kernels[unroll], sms * per_sm, threads, storage)
                items.append({"what": "read_floor", "dtype": dtype, "k": k, "n": n,
                              "bytes": nbytes, "unroll": unroll, "threads": threads,
                              "blocks": sms * per_sm})
        torch.cuda.synchronize()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "read_floor_items.json").write_text(json.dumps(
        {"machine": torch.cuda.get_device_name(), "sms": sms, "items": items}, indent=1))
    print(f"launched {len(items)} items")
    return 0


def _by_item(rows: list[dict], items: list[dict]) -> list[list[dict]]:
    """The kernels of each item: those after its marker, up to the next; of a read item,
    only its read kernel (the next shape's setup runs after a shape's last item, before
    the next marker)."""
    groups: list[list[dict]] = []
    for row in rows:
        if row["name"] == MARK:
            groups.append([])
        elif groups:
            groups[-1].append(row)
    if len(groups) != len(items):
        raise SystemExit(f"{len(items)} items launched but {len(groups)} markers profiled")
    return [[r for r in group if r["name"].startswith("read_floor_u")]
            if item["what"] == "read_floor" else group for item, group in zip(items, groups)]


def summary(args) -> int:
    launched = json.loads((args.ncu.parent / "read_floor_items.json").read_text()
                          if args.items is None else args.items.read_text())
    items = launched["items"]
    groups = _by_item(ncu_kernels(args.ncu), items)
    gemv = json.loads(args.gemv.read_text())["kernels"] if args.gemv and args.gemv.exists() else {}
    result = {"machine": launched["machine"], "command": args.command,
              "what": __doc__.split("\n\n", maxsplit=1)[0], "copy_tbps": args.copy_tbps,
              "shapes": {}}
    print(f"{'M = 1, weights':22s} {'MB':>6s} {'read floor':>10s} {'cuBLAS':>8s} "
          f"{'grape kn':>8s} {'grape nk':>8s} {'floor %copy':>11s} {'kn/floor':>8s} "
          f"{'nk/floor':>8s} {'cuBLAS/floor':>12s}")
    for dtype, k, n in shapes():
        mine = [(item, group) for item, group in zip(items, groups)
                if (item["dtype"], item["k"], item["n"]) == (dtype, k, n)]
        floors = [(sum(r[TIME] for r in g), item) for item, g in mine
                  if item["what"] == "read_floor"]
        floor_us, floor_item = min(floors, key=lambda f: f[0])
        cublas = next(g for item, g in mine if item["what"] == "cublas")
        cublas_us = sum(r[TIME] for r in cublas)
        nbytes = floor_item["bytes"]
        def of_copy(us: float) -> float:  # the share of the copy bandwidth reading nbytes in us
            return nbytes / us / 1e6 / args.copy_tbps

        entry = {"bytes": nbytes, "read_floor_us": floor_us,
                 "read_floor_config": {key: floor_item[key] for key in ("unroll", "threads", "blocks")},
                 "read_floor_fraction_of_copy": of_copy(floor_us),
                 "cublas_us": cublas_us, "cublas_kernels": [r["name"][:80] for r in cublas],
                 "cublas_over_read_floor": cublas_us / floor_us}
        for layout in ("kn", "nk"):  # grape's GEMV with weights [K, N] and [N, K]
            grape = gemv.get(f"matmul_{layout}_{dtype}_{k}x{n}.gemv.cuda.grape")
            if grape:
                entry[f"grape_{layout}_us"] = grape["us"]
                entry[f"grape_{layout}_over_read_floor"] = grape["us"] / floor_us
                entry[f"grape_{layout}_fraction_of_copy"] = of_copy(grape["us"])
        result["shapes"][f"{dtype} {k}x{n}"] = entry
        nan = float("nan")
        print(f"{dtype + f' {k}x{n}':22s} {nbytes / 1e6:6.2f} {entry['read_floor_us']:10.2f} "
              f"{entry['cublas_us']:8.2f} {entry.get('grape_kn_us', nan):8.2f} "
              f"{entry.get('grape_nk_us', nan):8.2f} "
              f"{100 * entry['read_floor_fraction_of_copy']:10.0f}% "
              f"{entry.get('grape_kn_over_read_floor', nan):8.2f} "
              f"{entry.get('grape_nk_over_read_floor', nan):8.2f} "
              f"{entry['cublas_over_read_floor']:12.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "read_floor.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    run = sub.add_parser("launch", help="launch every item once (run it under ncu)")
    run.add_argument("--cubin", type=Path, required=True, help="read_floor.cu built for sm_90")
    run.add_argument("--out", type=Path, default=Path("bench/results"))
    summ = sub.add_parser("summary", help="join ncu's CSV with the items and grape's GEMVs")
    summ.add_argument("--ncu", type=Path, required=True)
    summ.add_argument("--items", type=Path, help="default: read_floor_items.json beside --ncu")
    summ.add_argument("--gemv", type=Path, help="gemv_ncu.json of the same run (if there)")
    summ.add_argument("--copy-tbps", type=float, default=4.25)
    summ.add_argument("--command", default="bash bench/gpu/run_all.sh (step read_floor)")
    summ.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    return launch(args) if args.mode == "launch" else summary(args)


if __name__ == "__main__":
    sys.exit(main())
