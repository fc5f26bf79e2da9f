"""grape's ``grape_fill`` kernel (a library memset as a kernel, in topology graphs) against a
memset node, by size.

    python3 bench/fill_kernel.py --cubin PATCH_CUBIN --out OUT

``PATCH_CUBIN``: ``runtime/kernels/patch.cu`` built with ``nvcc --cubin -arch=sm_90``. For each
size, 20 fills of a zeroed buffer captured in one CUDA graph, as ``runtime/topology_graph.py``
launches them (``FILL_BLOCK`` threads, ``fill_blocks`` blocks, 4-byte elements)
and as ``cuMemsetD32Async``; replays timed by CUDA events. Prints a table, writes
``fill_kernel.json``. Needs torch, cuda-python and grape-tvm's runtime on a GPU host.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch
from cuda.bindings import driver

from grape_tvm.runtime.cuda_compile import kernel_params
from grape_tvm.runtime.cuda_driver import check
from grape_tvm.runtime.topology_graph import FILL_BLOCK, fill_blocks

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run with -P too
from torch_graph_timing import graph_us  # noqa: E402  pylint: disable=wrong-import-position

SIZES = (64, 4096, 1 << 20, 16 << 20, 64 << 20)  # bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cubin", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    torch.zeros(1, device="cuda")
    module = check(driver.cuModuleLoadData(args.cubin.read_bytes()), "cuModuleLoadData")
    fill = check(driver.cuModuleGetFunction(module, b"grape_fill"), "cuModuleGetFunction")
    rows = []
    for size in SIZES:
        buffer = torch.ones(size // 4, dtype=torch.int32, device="cuda")
        width = size // 4
        storage = kernel_params([("u64", buffer.data_ptr()), ("u64", size), ("u64", width),
                                 ("u64", 1), ("u32", 0), ("u32", 4)])
        blocks = fill_blocks(width)

        def by_kernel():
            stream = torch.cuda.current_stream().cuda_stream
            check(driver.cuLaunchKernel(fill, blocks, 1, 1, FILL_BLOCK, 1, 1, 0, stream,
                                         ctypes.addressof(storage[1]), 0), "cuLaunchKernel")

        def by_memset():
            stream = torch.cuda.current_stream().cuda_stream
            check(driver.cuMemsetD32Async(buffer.data_ptr(), 0, width, stream), "cuMemsetD32Async")

        by_kernel()
        torch.cuda.synchronize()
        assert int(buffer.abs().sum()) == 0, "grape_fill left nonzero elements"
        row = {"bytes": size, "grape_fill_us": graph_us(by_kernel),
               "memset_us": graph_us(by_memset)}
        rows.append(row)
        print(f"{size:>10} B  grape_fill {row['grape_fill_us']:8.2f} us  memset "
              f"{row['memset_us']:8.2f} us", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fill_kernel.json").write_text(json.dumps({
        "machine": torch.cuda.get_device_name(),
        "what": "us per fill of a buffer of `bytes`: 20 fills in one CUDA graph, replays "
                "timed by CUDA events; grape_fill as topology graphs launch it, against "
                "cuMemsetD32Async", "sizes": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
