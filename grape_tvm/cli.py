"""``grape-tvm``: compile, run and inspect models from the command line.

    grape-tvm compile MODEL.onnx -o MODEL.grape [--target llvm|cuda|JSON] [--dim NAME=LO:HI ...]
                      [--max-memory GIB] [--tensor-parallel N]
    grape-tvm run MODEL.grape --inputs IN.npz --outputs OUT.npz [--device cpu|cuda]
    grape-tvm inspect MODEL.grape [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import zipfile
import zlib
from pathlib import Path

import numpy as np

from grape_tvm.artifact import MATMUL_IMPLEMENTATIONS, Artifact, write_atomically
from grape_tvm.loader import load
from grape_tvm.loop import load_onnx_loop, step_has_branches
from grape_tvm.runtime.cublaslt import FUNCTION_PREFIX
from grape_tvm.runtime.cublaslt import LIBRARY as CUBLASLT
from grape_tvm.runtime.onnx_loop import is_onnx_loop
from grape_tvm.runtime.tensor_parallel import PLAN_KEY as TENSOR_PARALLEL_KEY


def _parse_dims(items: list[str]) -> dict[str, str]:
    dims = {}
    for item in items:
        name, sep, rng = item.partition("=")
        name, rng = name.strip(), rng.strip()
        if not sep or not name:
            raise ValueError(f"--dim takes NAME=LO:HI, got {item!r}")
        if name in dims:
            raise ValueError(f"--dim {name} is given twice ({dims[name]} and {rng}): give each "
                             "dimension one range")
        dims[name] = rng
    return dims


def _check_output(raw: str, option: str, *inputs: Path) -> Path:
    """The output path ``raw`` as given, refused before any work where it cannot be
    written: a folder, a folder missing or read-only, or one of the command's ``inputs``
    (which writing it would destroy)."""
    path = Path(raw)
    if path.is_dir() or raw.endswith(("/", os.sep)):
        raise ValueError(f"{option} {raw} is a folder, expected a file name")
    if not path.parent.is_dir():
        raise ValueError(f"{option} {path}: folder {path.parent} does not exist")
    if path.exists() and not path.is_file():  # a device or a pipe: written to, not replaced
        if not os.access(path, os.W_OK):
            raise ValueError(f"{option} {path} is not writable")
    elif not os.access(path.parent, os.W_OK):  # a file is written beside it, then renamed
        raise ValueError(f"{option} {path}: folder {path.parent} is not writable")
    for given in inputs:
        if path.exists() and given.exists() and path.samefile(given):
            raise ValueError(f"{option} {path} is also an input of this command: writing it "
                             "would destroy that input; give another file name")
    return path


def _max_memory_bytes(gib: float) -> int:
    if not math.isfinite(gib) or gib <= 0:
        raise ValueError(f"--max-memory takes a positive number of GiB, got {gib}")
    return int(gib * 2**30)


def cmd_compile(args: argparse.Namespace) -> int:
    # Here, not above: run and inspect work where neither onnx nor TVM's compiler is installed.
    from grape_tvm.onnx_compiler import compile_onnx  # pylint: disable=import-outside-toplevel

    output = _check_output(args.output, "-o", args.model)
    max_memory = _max_memory_bytes(args.max_memory)
    if args.select_ops < 0:
        raise ValueError(f"--select-ops takes a number of operators, 0 or more, got "
                         f"{args.select_ops}")
    if args.tensor_parallel < 1:
        raise ValueError(f"--tensor-parallel takes a number of devices, 1 or more, got "
                         f"{args.tensor_parallel}")
    dims = _parse_dims(args.dim)
    start = time.perf_counter()
    print(f"compiling {args.model} for {args.target} ...", file=sys.stderr, flush=True)
    weights = [name.strip() for item in args.weights for name in item.split(",") if name.strip()]
    module = compile_onnx(args.model, dims, args.target, select_ops=args.select_ops,
                          max_memory=max_memory, matmul=args.matmul,
                          weights=weights, tensor_parallel=args.tensor_parallel)
    path = module.export(output)
    regions = module.plan["regions"]
    conditionals = len(module.plan.get("conditionals", []))
    print(f"wrote {path} ({path.stat().st_size} bytes) in {time.perf_counter() - start:.1f} s: "
          f"{len(regions)} graph region(s), {conditionals} conditional region(s), "
          f"{len(module.plan['host_steps'])} host step(s)")
    return 0


def _read_inputs(path: Path) -> dict[str, np.ndarray]:
    """The arrays of an .npz file, by name. Only arrays of numbers are read: never pickled
    objects (np.load's allow_pickle stays off)."""
    if path.is_dir():
        raise ValueError(f"--inputs {path} is a folder, expected an .npz file")
    if not path.is_file():
        raise FileNotFoundError(f"--inputs {path}: no such file")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"--inputs {path} is not an .npz file (np.savez, one array per input "
                         "name)")
    with np.load(path, allow_pickle=False) as npz:
        return {name: _read_array(npz, name, path) for name in npz.files}


def _read_array(npz, name: str, path: Path) -> np.ndarray:
    try:
        array = npz[name]
    except (zipfile.BadZipFile, zlib.error, EOFError) as err:  # a checksum, a truncation
        raise ValueError(f"input {name!r} in {path} is damaged: {err}") from None
    except ValueError as err:  # object arrays need pickle: refused
        raise ValueError(f"input {name!r} in {path} is not an array of numbers: {err}") from None
    except MemoryError:  # the size its header declares
        raise ValueError(f"input {name!r} in {path} is larger than this host's memory") from None
    if not isinstance(array, np.ndarray):  # a zip member that is no .npy
        raise ValueError(f"input {name!r} in {path} is not an array (.npy) but "
                         f"{len(array)} bytes of something else")
    return array


def _write_outputs(path: Path, outputs: dict, note: str = "") -> None:
    """All outputs in one .npz file at exactly ``path`` (np.savez would add ".npz" to another
    name), in place of any earlier file only once complete."""
    write_atomically(path, lambda file: _write_npz(file, outputs))
    shapes = ", ".join(f"{k}{tuple(v.shape)}" for k, v in outputs.items())
    print(f"wrote {path}: {shapes}{note}")


def _write_npz(file, arrays: dict[str, np.ndarray]) -> None:
    """``arrays`` as np.savez writes them (a member NAME.npy each), under any names: np.savez
    takes them as keyword arguments, where ``file`` or ``allow_pickle`` are its own."""
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as npz:
        for name, array in arrays.items():
            with npz.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)


def cmd_run(args: argparse.Namespace) -> int:
    args.outputs = _check_output(args.outputs, "--outputs", args.model, args.inputs)
    inputs = _read_inputs(args.inputs)
    if _is_onnx_loop(args.model):
        return _run_onnx_loop(args, inputs)
    if TENSOR_PARALLEL_KEY in Artifact.load(args.model).manifest["plan"]:
        return _run_tensor_parallel(args, inputs)
    executor = load(args.model, device=args.device)
    try:
        # weights the build reads transposed are bound (transposed once), not passed
        executor.bind_inputs({k: v for k, v in inputs.items() if k in executor.transposed_inputs})
        outputs = executor.run({k: v for k, v in inputs.items()
                                if k not in executor.transposed_inputs})
    finally:
        executor.close()
    _write_outputs(args.outputs, outputs)
    return 0


def _run_tensor_parallel(args: argparse.Namespace, inputs: dict) -> int:
    """A tensor-parallel artifact on its ranks: on CUDA a process per GPU (0..N-1) and NCCL;
    on the CPU threads, with whatever collectives disco has (this TVM wheel has none)."""
    from grape_tvm.tensor_parallel_session import load_tensor_parallel  # pylint: disable=import-outside-toplevel

    on_gpu = args.device.startswith("cuda")
    with load_tensor_parallel(args.model, threaded=not on_gpu,
                              ccl="nccl" if on_gpu else None) as ranks:
        outputs = ranks.run(inputs)
        note = f" on {ranks.world_size} ranks"
    _write_outputs(args.outputs, outputs, note)
    return 0


def _is_onnx_loop(path: Path) -> bool:
    return is_onnx_loop(Artifact.load(path).manifest)


def _run_onnx_loop(args: argparse.Namespace, inputs: dict) -> int:
    with load_onnx_loop(args.model, args.device) as loop:
        outputs = loop.run(inputs)
    _write_outputs(args.outputs, outputs, f" after {loop.steps} loop step(s) ({loop.mode})")
    return 0


def describe(manifest: dict) -> dict:
    """The ``inspect --json`` object: dims, inputs, outputs, regions, host steps, notes.
    An ONNX Loop's inputs and outputs are its graph's, which ``run`` takes and returns (the
    artifact's own signature is the loop step's)."""
    plan = manifest["plan"]
    sig = manifest.get("loop", {}).get("onnx", {}).get("signature") or manifest["signature"]
    return {
        "target": manifest["target"],
        "dims": {k: {"lo": v[0], "hi": v[1]} for k, v in sig["dims"].items()},
        "inputs": sig["inputs"],
        "outputs": sig["outputs"],
        "regions": plan["regions"],
        "matmul": _matmul_description(plan),
        # bound inputs (weights) the build reads [N, K]: bind_inputs transposes them once
        "transposed_inputs": plan.get("transposed_inputs", []),
        "conditionals": _conditional_description(manifest),
        "host_steps": plan["host_steps"],
        "host_bookkeeping": plan.get("host_bookkeeping", 0),
        "call_program": _program_description(plan),
        "notes": plan.get("notes", []),
        "executor": ("one CUDA graph per region and topology (per-shape argument tables "
                     "patched on the device), recorded on first sight"
                     if manifest["target"]["kind"] == "cuda"
                     else "CPU replay of each region's recorded kernel calls, per shape"),
        "loop": _loop_description(manifest),
        "tensor_parallel": plan.get(TENSOR_PARALLEL_KEY),
        "cubins_prebuilt": len(manifest.get("cubins", [])),
        "versions": {"grape_tvm": manifest.get("grape_tvm_version"),
                     "tvm": manifest.get("tvm_version")},
        "sections": manifest.get("sections", []),
    }


def _matmul_description(plan: dict) -> str:
    """What runs the model's matmuls (``build(matmul=...)``)."""
    chosen = plan.get("matmul", "tvm")
    if chosen in (CUBLASLT, "auto"):
        calls = sorted({k for r in plan["regions"] for k in r["kernels"]
                        if k.startswith(FUNCTION_PREFIX)})
        text = ("cuBLASLt, called inside the graphs (an algorithm per power-of-two bucket of "
                f"the rows; inspect --record lists them): {', '.join(calls) or 'none matched'}; "
                "other matmuls TVM's schedules with grape's rules")
        gemv = plan.get("gemv_rows", {})
        if gemv:
            text = ("grape's GEMV kernels (epilogue fused) where the rows M are few ("
                    + ", ".join(f"{f}: M <= {max(rows)}" for f, rows in sorted(gemv.items()))
                    + "); above them, and for every other matmul with a weight, " + text)
        elif chosen == "auto":
            text = "grape's GEMV kernels took no matmul (none had one symbolic row dim); " + text
        return text
    return "TVM's schedules" + (" with grape's rules" if chosen == "grape" else "")


def _conditional_description(manifest: dict) -> list[dict]:
    """Each conditional region (a data-dependent ``if`` kept off the host): its branches
    and where its condition is read."""
    on_gpu = manifest["target"]["kind"] == "cuda"
    where = ("on the device by each branch region's patch kernel, which disables the nodes "
             "of the branch not taken" if on_gpu else "by the CPU replay, before each branch region")
    return [dict(c, condition_read=where,
                 host_read="only by a call that meets a branch region not yet recorded at "
                           "its shape (TVM's VM runs the conditional and records the branch "
                           "taken; the other is recorded without running)")
            for c in manifest["plan"].get("conditionals", [])]


def _loop_description(manifest: dict) -> dict | None:
    """How a ``compile_loop`` artifact runs its loop (``loop_runner``'s choice, mode "auto"),
    and where its stop is decided."""
    loop = manifest.get("loop")
    if loop is None:
        return None
    on_gpu = manifest["target"]["kind"] == "cuda"
    if on_gpu and not step_has_branches(manifest):
        runs_as = ("one CUDA graph per state shape: a WHILE conditional node whose body is the "
                   "step's kernels; the stop flag is read on the device (no host sync per step)")
    else:
        runs_as = "a host loop: one call per step, the stop flag read back after each"
        if on_gpu:
            runs_as += (" (the step has data-dependent branches, which a device loop cannot "
                        "capture yet)")
    return {
        "carried": loop["carried"], "stop": loop["stop"], "max_steps": loop["max_steps"],
        "from_onnx_loop": "onnx" in loop, "runs_as": runs_as,
    }


def _shape(spec: dict) -> str:
    return "(" + ", ".join(str(d) for d in spec["shape"]) + ")"


def _print_description(d: dict) -> None:
    print(f"target: {json.dumps(d['target'])}   executor: {d['executor']}")
    print("dims:")
    for name, r in d["dims"].items():
        print(f"  {name} = {r['lo']}..{r['hi']}")
    for key in ("inputs", "outputs"):
        print(f"{key}:")
        for spec in d[key]:
            print(f"  {spec['name']}: {spec['dtype']}{_shape(spec)}")
    print(f"matmuls: {d['matmul']}")
    if d["transposed_inputs"]:
        print(f"weights read transposed: {', '.join(d['transposed_inputs'])} (bind them once "
              "with bind_inputs, which transposes them; run refuses them)")
    print(f"regions (run as graphs): {len(d['regions'])}")
    for r in d["regions"]:
        print(f"  {r['name']}: {len(r['kernels'])} kernel(s), keyed by "
              f"{r['symbolic_vars'] or 'nothing (static)'}: {', '.join(r['kernels'])}")
    print(f"conditional regions (data-dependent branches, no host read): {len(d['conditionals'])}")
    for c in d["conditionals"]:
        print(f"  {c['name']}: if {c['condition']}: {', '.join(c['then_calls'])} "
              f"else: {', '.join(c['else_calls'])} ({c['kernels']} kernel(s)); {c['mode']}")
    if d["conditionals"]:
        print(f"  condition read {d['conditionals'][0]['condition_read']}; host read "
              f"{d['conditionals'][0]['host_read']}")
    program = d["call_program"]
    if "error" in program:
        print(f"call program: none ({program['error']}): TVM's VM runs main")
    else:
        print(f"call program: {program['steps']} step(s) over {program['storages']} storage(s) "
              f"and {program['views']} view(s): calls run without TVM's VM")
    print(f"host steps: {len(d['host_steps'])} (plus {d['host_bookkeeping']} VM shape checks)")
    for h in d["host_steps"]:
        print(f"  {h['function']}.{h['var']} = {h['op']}: {h['reason']}")
    for note in d["notes"]:
        print(f"note: {note}")
    parallel = d.get("tensor_parallel")
    if parallel:
        print(f"tensor parallel: {parallel['world_size']} devices; inputs split (axis): "
              f"{_axes(parallel['shard_plan'])}; outputs split: "
              f"{_axes(parallel['output_shard_plan'])}")
        if parallel.get("weights"):
            print(f"  carries {len(parallel['weights'])} whole weight(s), bound as it loads; "
                  f"columns in rank order: {', '.join(parallel.get('columns_by_ranks', {}))}")
    loop = d.get("loop")
    if loop and loop["from_onnx_loop"]:
        print(f"loop (an ONNX Loop): state {loop['carried']}, stops on its condition or after "
              f"its trip count M; without M, after {loop['max_steps']} steps at most")
    elif loop:
        print(f"loop: state {loop['carried']}, stops on {loop['stop']!r} or after "
              f"{loop['max_steps']} steps")
    if loop:
        print(f"  runs as {loop['runs_as']}")


def _axes(plan: dict) -> str:
    return ", ".join(f"{name} ({axis})" for name, axis in plan.items()) or "none"


def _program_description(plan: dict) -> dict:
    described = plan.get("call_program")
    if described is None:
        return {"error": "the artifact predates call programs"}
    if "error" in described:
        return {"error": described["error"]}
    return {key: len(described[key]) for key in ("steps", "storages", "views")}


def cmd_inspect(args: argparse.Namespace) -> int:
    description = describe(Artifact.load(args.model).manifest)
    if args.record:
        description["graphs"] = _record(args)
    if args.json:
        print(json.dumps(description, indent=2, default=list))
    else:
        _print_description(description)
        if args.record:
            _print_graphs(description["graphs"])
    return 0


def _record(args: argparse.Namespace) -> dict:
    """Record every shape of the declared ranges on a device: what the graphs then hold."""
    if TENSOR_PARALLEL_KEY in Artifact.load(args.model).manifest["plan"]:
        raise ValueError(f"inspect --record takes an artifact of one device; {args.model} is "
                         "built for tensor parallelism (its ranks record as they run)")
    executor = load(args.model, device=args.device)
    try:
        # weights the build reads transposed must be bound: zeros stand for them here
        executor.bind_inputs({t.name: np.zeros(t.shape, t.dtype) for t in executor.signature.inputs
                              if t.name in executor.transposed_inputs})
        seconds = executor.record_all(progress=not args.json)
        return {**executor.backend.describe(), "record_seconds": seconds}
    finally:
        executor.close()


def _print_graphs(graphs: dict) -> None:
    print(f"recorded every shape in {graphs['record_seconds']:.1f} s on {graphs['backend']} "
          f"({graphs.get('mode')}):")
    if graphs.get("fallback_reason"):
        print(f"  fallback: {graphs['fallback_reason']}")
    if "graph_device_bytes" in graphs:
        tables = sum(g.get("graph_table_device_bytes", 0)
                     for groups in graphs.get("topology_groups", {}).values() for g in groups)
        print(f"  {graphs.get('graphs_instantiated', 0)} instantiated graph(s); device memory "
              f"for graphs and tables, as free memory dropped (2 MiB steps): "
              f"{graphs['graph_device_bytes']} bytes; table buffers allocated: {tables} bytes")
    for region, groups in graphs.get("topology_groups", {}).items():
        for i, g in enumerate(groups):
            print(f"  {region} group {i}: {g['shapes']} shape(s), {g['nodes']} kernel node(s), "
                  f"{g['columns']} varying column(s); argument tables {g['table_bytes_uncompressed']}"
                  f" bytes in full, {g['table_bytes_compressed']} compressed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grape-tvm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compile", help="compile an ONNX model into a .grape artifact")
    p.add_argument("model", type=Path, help="the ONNX model")
    p.add_argument("-o", "--output", required=True, help="the artifact to write")
    p.add_argument("--target", default="llvm",
                   help='llvm, cuda (sm_90) or a TVM target JSON, e.g. \'{"kind": "cuda", "arch": "sm_80"}\'')
    p.add_argument("--select-ops", type=int, default=16, metavar="N",
                   help="a data-dependent if whose branches have at most N operators becomes "
                        "a select (both computed); larger ones conditional regions (default 16; "
                        "0: every if a conditional region)")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=LO:HI",
                   help="range of a symbolic dimension (an ONNX dim_param); repeat per dimension")
    p.add_argument("--matmul", choices=MATMUL_IMPLEMENTATIONS, default=None,
                   help="what runs matmuls with a weight: auto (the default on cuda: grape's "
                        "GEMV kernels for few rows, cuBLASLt calls captured into the graphs "
                        "above), cublaslt (cuBLASLt at every row count), grape (grape's GEMV "
                        "kernels for few rows, TVM's schedules above; cuda) or tvm (TVM's "
                        "schedules; the default on llvm)")
    p.add_argument("--weights", action="append", default=[], metavar="NAME[,NAME...]",
                   help="inputs that are weights, bound once at run time (bind_inputs): the "
                        "build may read them in its own layout (a [K, N] matmul weight as "
                        "[N, K]), made once as they are bound; repeat or separate by commas")
    p.add_argument("--max-memory", type=float, default=64, metavar="GIB",
                   help="refuse ranges whose memory, planned at their upper bounds and allocated "
                        "by every call, exceeds this many GiB (default 64)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="shard a decoder over N devices Megatron's way (attention by heads, "
                        "the MLP by its inner dim; the weights carried in the artifact); run "
                        "it with grape_tvm.load_tensor_parallel (default 1: one device)")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("run", help="run an artifact on inputs from an .npz file")
    p.add_argument("model", type=Path)
    p.add_argument("--inputs", type=Path, required=True, help=".npz with one array per input name")
    p.add_argument("--outputs", required=True, help=".npz to write, one array per output")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("inspect", help="show dims, inputs, outputs, graph regions and host steps")
    p.add_argument("model", type=Path)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--record", action="store_true",
                   help="also record every shape on --device and show the graphs, topology "
                        "groups and argument tables that serve them")
    p.add_argument("--device", default="cpu", help="cpu or cuda, with --record")
    p.set_defaults(func=cmd_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError, RuntimeError) as err:
        print(f"grape-tvm {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
