"""Export every zoo architecture, compile it with grape for llvm and CUDA, and check the
llvm build against onnxruntime at the range's smallest, middle and top shapes, and, for a
decoder, its greedy tokens over the whole past range (``generated_tokens``).

    python3 bench/zoo/run.py --out bench/results            # writes bench/results/zoo.json
    python3 bench/zoo/run.py --out /tmp/zoo --models llama,vit

CUDA is built only (the kernels compiled to cubins with nvcc): nothing here runs on a GPU.
The GPU half is ``bench/zoo/gpu.py`` on the GPU host (``run_all.sh`` step ``zoo``), at the
models' full size; ``python3 bench/zoo/gpu.py --merge OUT/zoo_gpu.json ...`` merges its
results in as each model's ``"gpu"`` entry (a new run of this script writes zoo.json
without them).

A model whose default export fails to export or compile is exported again the next way a
user would try (``Architecture.exports``); every attempt is kept, a failure as its one-line
reason. The export used is then made again by the dynamo exporter (``torch.onnx.export(...,
dynamo=True)``, which needs onnxscript) and checked the same way: ``dynamo_export``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from architectures import (  # noqa: E402  pylint: disable=wrong-import-position
    ARCHITECTURES, TOLERANCE, Architecture, Export, errors_against_onnxruntime,
    tokens_against_onnxruntime)

CUDA = {"kind": "cuda", "arch": "sm_90"}


def machine() -> str:
    """The CPU and the versions that decide the export and the reference."""
    import onnxruntime  # pylint: disable=import-outside-toplevel
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel

    cpuinfo = Path("/proc/cpuinfo")
    models = [ln.split(":", 1)[1].strip() for ln in
              (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
              if ln.startswith("model name")]
    cpu = f"{len(models)} x {models[0]}" if models else platform.machine()
    return (f"CPU only ({cpu}); torch {torch.__version__}, transformers "
            f"{transformers.__version__}, onnxruntime {onnxruntime.__version__}")


def one_line(err: BaseException) -> str:
    """The exception's type and the last line of its message (TVM's carry tracebacks)."""
    lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[-1][:400] if lines else ''}"


def compile_timed(path: Path, arch: Architecture, target, artifact: Path) -> dict:
    import grape_tvm  # pylint: disable=import-outside-toplevel

    start = time.perf_counter()
    module = grape_tvm.compile_onnx(path, dims=arch.dims, target=target)
    seconds = time.perf_counter() - start
    module.export(artifact)
    return {"compile_seconds": round(seconds, 2), "artifact_bytes": artifact.stat().st_size,
            "cubins": len(module.cubins)}


def check_llvm(path: Path, arch: Architecture, workdir: Path) -> dict:
    """Compile ``path`` for llvm, run it against onnxruntime on the same file."""
    import grape_tvm  # pylint: disable=import-outside-toplevel

    artifact = workdir / f"{arch.name}.llvm.grape"
    result = compile_timed(path, arch, "llvm", artifact)
    executor = grape_tvm.load(artifact)
    shapes = errors_against_onnxruntime(executor, path, arch, arch.shapes())
    worst = max(s["relative_error"] for s in shapes)
    tokens = tokens_against_onnxruntime(executor, path, arch) if arch.cache else None
    return {**result, "shapes": shapes, "max_relative_error": worst,
            **({"generated_tokens": tokens} if tokens else {}),
            "matches_onnxruntime": worst <= TOLERANCE and (not tokens or tokens["tokens_equal"])}


def record(attempt: dict, step: str, run):
    """``run()``, recorded as ``attempt[step]``: its value, or its failure in one line (and
    None returned)."""
    try:
        attempt[step] = value = run()
    except Exception as err:  # pylint: disable=broad-except
        attempt[step] = one_line(err)
        return None
    return value


def try_export(arch: Architecture, how: Export, workdir: Path) -> dict:
    """One export, its llvm build and check, and (when llvm built) its CUDA build; the
    first step that fails holds its one-line reason and ends the attempt."""
    attempt = {"export": how.label()}
    path = workdir / f"{arch.name}.onnx"
    if record(attempt, "exported", lambda: arch.export(path, how)) is None:
        return attempt
    attempt["exported"] = True  # the path is workdir's, gone after the run
    if record(attempt, "llvm", lambda: check_llvm(path, arch, workdir)):
        record(attempt, "cuda",
               lambda: compile_timed(path, arch, CUDA, workdir / f"{arch.name}.cuda.grape"))
    return attempt


def run_architecture(arch: Architecture, workdir: Path) -> dict:
    """The architecture's exports in order until one builds for llvm; the model's entry
    describes that one (or the last), and every attempt is kept. Then the same export by
    the dynamo exporter, reported apart (``dynamo_export``)."""
    attempts = []
    for how in arch.exports:
        attempts.append(try_export(arch, how, workdir))
        if isinstance(attempts[-1].get("llvm"), dict):
            break
    used = arch.exports[len(attempts) - 1]
    dynamo = try_export(arch, replace(used, dynamo=True), workdir)
    return {
        "dims": {d: list(r) for d, r in arch.dims.items()},
        **summary(arch, attempts[-1]),
        "attempts": attempts,
        "dynamo_export": summary(arch, dynamo),
    }


def summary(arch: Architecture, attempt: dict) -> dict:
    """What one attempt (``try_export``) came to: compiled, matched, the worst error."""
    llvm = attempt.get("llvm", "not built: export failed")
    cuda = attempt.get("cuda", "not built: llvm failed")
    exported = attempt["exported"]
    return {
        "export": attempt["export"],
        "exported": exported,
        "compiles": {"llvm": isinstance(llvm, dict) or llvm,
                     "cuda": isinstance(cuda, dict) or cuda},
        "matches_onnxruntime": isinstance(llvm, dict) and llvm["matches_onnxruntime"],
        "max_relative_error": llvm["max_relative_error"] if isinstance(llvm, dict) else None,
        **({"generated_tokens": llvm.get("generated_tokens")}
           if arch.cache and isinstance(llvm, dict) else {}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for zoo.json")
    parser.add_argument("--models", default=",".join(ARCHITECTURES))
    args = parser.parse_args(argv)
    models = {}
    with tempfile.TemporaryDirectory(prefix="grape-zoo-") as tmp:
        for name in args.models.split(","):
            print(f"{name} ...", flush=True)
            models[name] = run_architecture(ARCHITECTURES[name], Path(tmp))
            print(json.dumps({k: models[name][k] for k in ("compiles", "matches_onnxruntime")}),
                  "dynamo exporter:", json.dumps(
                      {k: models[name]["dynamo_export"][k]
                       for k in ("compiles", "matches_onnxruntime")}), flush=True)
    result = {
        "machine": machine(),
        "command": shlex.join(["python3", *sys.argv]),
        "gpu": "not merged: bench/zoo/gpu.py runs on the GPU host, then --merge its zoo_gpu.json",
        "tolerance": {"relative_error": TOLERANCE,
                      "measure": "max |grape - onnxruntime| / max |onnxruntime| per output, "
                                 "the worst output; fp32, llvm build on the CPU"},
        "models": models,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "zoo.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / 'zoo.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
