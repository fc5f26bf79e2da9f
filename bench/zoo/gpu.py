"""The zoo on the GPU: each model at its full size (``architectures.FULL``: BERT-base,
ViT-B/16, ResNet-50, BART-base, Whisper-tiny, a 12-layer Llama), its CUDA build against
onnxruntime and PyTorch, and its latency against PyTorch eager (and ``torch.compile`` with
``--compiled``) at three shapes.

On the GPU host, from ``make gpu-artifacts`` (step ``zoo``: ``build/gpu/zoo/NAME.onnx``,
weightless, ``NAME.cuda.grape``, ``NAME.json``):

    python3 bench/zoo/gpu.py --artifacts build/gpu/zoo --out OUT [--compiled] [--models bert,vit]

The weights are made here: the architecture's PyTorch module from its config and seed,
whose ``state_dict`` gives the weight inputs by the build's weight map (no weight travels).
grape, onnxruntime and PyTorch all run on those weights. Per model and shape (the range's
smallest, middle and top, every dim at once; the seeded feeds of ``architectures.py``):
- ``vs_onnxruntime``: grape on CUDA against onnxruntime on the CPU, on the same export
  (the worst output's max |diff| / max |reference|);
- ``vs_torch``: against the PyTorch module on the GPU;
- ``grape_ms``, ``torch_eager_ms`` (and ``torch_compiled_ms``: ``torch.compile``, default
  mode): median of ``--reps`` calls, inputs on the device, each call synchronized. TF32 off
  on both sides.
Writes ``OUT/zoo_gpu.json``. Back on the build machine, ``--merge OUT/zoo_gpu.json ...``
(one file per run, when the models ran in several) puts each model's shapes into
``bench/results/zoo.json`` as its ``"gpu"`` entry.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from architectures import (  # noqa: E402  pylint: disable=wrong-import-position
    FULL_ARCHITECTURES, SEED, relative_errors, weights)


def _flat(value) -> list:
    """A torch module's outputs as one list of tensors, in order (tuples of past states)."""
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v)]
    return [value]


def _median_ms(call, sync, reps: int) -> float:
    call()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_model(name: str, folder: Path, reps: int, compiled: bool) -> dict:
    import grape_tvm  # pylint: disable=import-outside-toplevel

    meta = json.loads((folder / f"{name}.json").read_text())
    with grape_tvm.load(folder / f"{name}.cuda.grape", "cuda") as executor:
        return _run_loaded(name, meta, executor, folder, reps, compiled)


def _run_loaded(name: str, meta: dict, executor, folder: Path, reps: int, compiled: bool) -> dict:
    """The model's three shapes on its loaded CUDA build (``run_model``)."""
    import onnxruntime  # pylint: disable=import-outside-toplevel
    import torch  # pylint: disable=import-outside-toplevel
    import tvm  # pylint: disable=import-outside-toplevel

    arch = FULL_ARCHITECTURES[name]
    if meta.get("size") != "full":
        raise ValueError(f"{folder / name}.json is not of a full-size zoo build: run "
                         "make gpu-artifacts again")
    module = arch.make_module(meta["attn_implementation"]).eval()
    made = weights(module, meta["weights"])
    executor.bind_inputs({k: tvm.runtime.tensor(v, executor.device) for k, v in made.items()})
    session = onnxruntime.InferenceSession(str(folder / f"{name}.onnx"),
                                           providers=["CPUExecutionProvider"])
    module = module.cuda()
    # Dynamo's caches are per code object, and the zoo's wrappers share theirs: without a
    # reset the models before would use up the recompile limit, and torch.compile would
    # fall back to eager without a word.
    torch._dynamo.reset()  # pylint: disable=protected-access
    fast = torch.compile(module) if compiled else None
    rng = np.random.default_rng(SEED)
    result = {"export": meta["export"], "size": meta["size"],
              "dims": {d: list(r) for d, r in arch.dims.items()}, "shapes": {}}
    for shape in arch.shapes():
        feeds = arch.make_feeds(rng, shape)
        on_device = {k: tvm.runtime.tensor(v, executor.device) for k, v in feeds.items()}
        args = tuple(torch.from_numpy(feeds[n]).cuda() for n in arch.inputs)
        got = executor.run(on_device)
        want = dict(zip(arch.outputs, session.run(list(arch.outputs), {**feeds, **made})))
        with torch.no_grad():
            ours = dict(zip(arch.outputs, (t.float().cpu().numpy() for t in _flat(module(*args)))))
            entry = {
                "vs_onnxruntime": relative_errors(got, want, arch.outputs),
                "vs_torch": relative_errors(got, ours, arch.outputs),
                "grape_ms": _median_ms(lambda f=on_device: executor.run(f, return_numpy=False),
                                       executor.backend.synchronize, reps),
                "torch_eager_ms": _median_ms(lambda: module(*args), torch.cuda.synchronize, reps),
            }
            if fast is not None:
                entry["torch_compiled_ms"] = _median_ms(lambda: fast(*args),
                                                        torch.cuda.synchronize, reps)
        key = ",".join(f"{d}={v}" for d, v in shape.items())
        result["shapes"][key] = entry
        print(f"  {name} {key}: " + ", ".join(
            f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in entry.items()),
            flush=True)
    return result


def merge(gpu_jsons: list[Path], zoo_json: Path) -> None:
    """The results of ``gpu_jsons`` (runs of some models each, on one machine) into
    ``zoo_json``: each model's ``gpu`` (its shapes), ``gpu_size`` and ``gpu_dims``, and
    where they come from."""
    runs = [json.loads(path.read_text()) for path in gpu_jsons]
    for key in ("machine", "tf32", "timing"):
        if len({json.dumps(run[key]) for run in runs}) != 1:
            raise ValueError(f"the runs differ in {key!r}: merge runs of one setup only")
    zoo = json.loads(zoo_json.read_text())
    zoo["gpu"] = {**{k: runs[0][k] for k in ("machine", "tf32", "timing")},
                  "command": " ; ".join(run["command"] for run in runs)}
    for run in runs:
        for name, result in run["models"].items():
            entry = zoo["models"].setdefault(name, {})
            entry["gpu"] = result.get("shapes", result)
            entry["gpu_size"] = result.get("size")
            entry["gpu_dims"] = result.get("dims")
    zoo_json.write_text(json.dumps(zoo, indent=1) + "\n")
    print(f"merged {', '.join(map(str, gpu_jsons))} into {zoo_json}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--merge", type=Path, nargs="+", default=None,
                        help="merge these zoo_gpu.json into bench/results/zoo.json and stop")
    parser.add_argument("--artifacts", type=Path, default=Path("build/gpu/zoo"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--models", default=None, help="comma-separated; all built ones if unset")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--compiled", action="store_true", help="also time torch.compile")
    args = parser.parse_args()
    if args.merge is not None:
        merge(args.merge, Path(__file__).resolve().parents[1] / "results" / "zoo.json")
        return 0
    if args.out is None:
        parser.error("--out is needed to run the models")
    import torch  # pylint: disable=import-outside-toplevel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    names = args.models.split(",") if args.models else \
        [n for n in FULL_ARCHITECTURES if (args.artifacts / f"{n}.cuda.grape").exists()]
    import transformers  # pylint: disable=import-outside-toplevel

    result = {"machine": f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
                         f"transformers {transformers.__version__}",
              "command": " ".join(["python3", *sys.argv]), "tf32": False,
              "timing": f"median of {args.reps} synchronized calls, inputs on the device",
              "models": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in names:
        print(f"{name} ...", flush=True)
        try:
            result["models"][name] = run_model(name, args.artifacts, args.reps, args.compiled)
        except Exception:  # pylint: disable=broad-except
            failed += 1
            result["models"][name] = {"error": traceback.format_exc().strip().splitlines()[-1]}
            print(traceback.format_exc(), flush=True)
        # After each model: a run stopped by its time limit keeps what it measured.
        (args.out / "zoo_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / 'zoo_gpu.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
