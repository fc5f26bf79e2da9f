"""Compile the artifacts the GPU tests and benchmarks load, on a machine without a GPU.

    python bench/gpu/build_artifacts.py build/gpu
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from blocks import make_blocks  # noqa: E402  pylint: disable=wrong-import-position

import grape_tvm  # noqa: E402  pylint: disable=wrong-import-position


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model = out / "blocks.onnx"
    onnx.save(make_blocks(), str(model))
    t0 = time.perf_counter()
    module = grape_tvm.compile_onnx(model, dims={"n": (1, 256)}, target="cuda")
    path = module.export(out / "blocks.cuda.grape")
    print(f"{path}: {path.stat().st_size} bytes, {len(module.cubins)} cubin(s), "
          f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "build/gpu"))
