"""``make demo``: compile the bundled example, run it at several shapes, check it, say what happened.

    python examples/demo.py [--device cpu|cuda] [--target llvm|cuda]

Compiles ``examples/blocks.onnx`` (n = 1..256) with grape-tvm, loads the artifact, runs it at
shapes in random order, and compares every output with onnxruntime when it is installed
(else with numpy's evaluation of the same blocks).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from blocks import make_blocks  # noqa: E402  pylint: disable=wrong-import-position

import grape_tvm  # noqa: E402  pylint: disable=wrong-import-position


def reference(model_path: Path):
    try:
        import onnxruntime as ort  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None, "none"
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    return (lambda x: session.run(None, {"x": x})[0]), "onnxruntime"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--target", default=None, help="default: llvm for cpu, cuda for cuda")
    parser.add_argument("--hi", type=int, default=256)
    parser.add_argument("--artifact", type=Path, default=None,
                        help="run this prebuilt artifact (a deployment host has no TVM compiler)")
    args = parser.parse_args()
    target = args.target or ("cuda" if args.device.startswith("cuda") else "llvm")

    model_path = HERE / "blocks.onnx"
    artifact = args.artifact
    if artifact is None:
        import onnx  # pylint: disable=import-outside-toplevel

        if not model_path.exists():
            onnx.save(make_blocks(), str(model_path))
        artifact = HERE / f"blocks.{'cuda' if 'cuda' in target else 'llvm'}.grape"
        t0 = time.perf_counter()
        module = grape_tvm.compile_onnx(model_path, dims={"n": (1, args.hi)}, target=target)
        module.export(artifact)
        print(f"compiled {model_path.name} for {target} in {time.perf_counter() - t0:.1f} s -> "
              f"{artifact.name}: {len(module.plan['regions'])} graph region(s), "
              f"{len(module.plan['host_steps'])} host step(s)")
    elif not model_path.exists():
        import onnx  # pylint: disable=import-outside-toplevel

        onnx.save(make_blocks(), str(model_path))  # the reference needs the same seeded model

    executor = grape_tvm.load(artifact, device=args.device)
    ref, ref_name = reference(model_path)
    rng = np.random.default_rng(0)
    shapes = [1, args.hi, 17, 1, 100, 17, args.hi, 3]
    worst = 0.0
    for n in shapes:
        x = rng.standard_normal((n, 64)).astype(np.float32)
        t = time.perf_counter()
        y = executor.run({"x": x})["y"]
        ms = (time.perf_counter() - t) * 1e3
        err = float(np.abs(y - ref(x)).max()) if ref else float("nan")
        worst = max(worst, err) if ref else worst
        print(f"  n={n:4d}  y{tuple(y.shape)}  {ms:8.2f} ms  max |y - {ref_name}| = {err:.2e}")
    s = executor.stats
    print(f"{s.calls} calls: {s.region_recordings} region recordings (new shapes), "
          f"{s.region_replays} replays; backend {executor.backend.describe()}")
    executor.close()
    if ref and worst > 1e-4:
        print(f"FAILED: max error {worst:.2e} > 1e-4")
        return 1
    print("ok" if ref else "ok (no reference installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
