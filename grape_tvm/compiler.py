"""Compile a Relax IRModule into a grape module and its artifact: ``build`` (a model),
``compile_loop`` (a loop's step). ONNX models are ``grape_tvm.onnx_compiler``'s."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tvm
from tvm import relax
from tvm_ffi.structural import structural_equal

import grape_tvm
from grape_tvm.artifact import Artifact
from grape_tvm.passes import HostFallbackError, graph_plan
from grape_tvm.passes.dependent_launch import supports_dependent_launch
from grape_tvm.passes.planned_memory import planned_bytes
from grape_tvm.pipeline import TIR_PIPELINE, grape_pipeline, is_gpu, matmul_implementation
from grape_tvm.runtime.call_program import CallProgram
from grape_tvm.runtime.attention import sources_of as attention_sources_of
from grape_tvm.runtime.cuda_compile import compile_cubin, nvcc_available, source_key
from grape_tvm.runtime.tensor_parallel import OUTPUTS_KEY as TENSOR_PARALLEL_OUTPUTS_KEY
from grape_tvm.runtime.tensor_parallel import PLAN_KEY as TENSOR_PARALLEL_KEY
from grape_tvm.runtime.tensor_parallel import placement_text
from grape_tvm.runtime.device_loop import LOOP_SOURCE, STOP_DTYPES, LoopSpec
from grape_tvm.runtime.topology_graph import PATCH_SOURCE
from grape_tvm.runtime.signature import ShapeRange, Signature, TensorSpec
from grape_tvm.target import parse_target, target_json


DEFAULT_MAX_MEMORY = 64 * 2**30  # bytes: more than a call should ever plan, less than a host has


class PlannedMemoryError(ValueError):
    """Memory planned at the declared upper bounds exceeds the limit: no call could run."""


@dataclass
class GrapeModule:
    """A compiled model: TVM's executable, its signature and its graph plan."""

    executable: Any  # relax.VMExecutable
    signature: Signature
    plan: dict
    target: dict
    cubins: dict[str, bytes] = field(default_factory=dict)
    loop: dict | None = None  # a LoopSpec's JSON, for modules made by compile_loop

    def manifest(self) -> dict:
        extra = {"loop": self.loop} if self.loop is not None else {}
        return {
            **extra,
            "grape_tvm_version": grape_tvm.__version__,
            "tvm_version": tvm.__version__,
            "target": self.target,
            "signature": self.signature.to_json(),
            "plan": self.plan,
            "cubins": sorted(self.cubins),
        }

    @property
    def program(self) -> CallProgram | None:
        """The call program the runtime runs calls from (None: the VM runs them)."""
        return CallProgram.from_plan(self.plan)

    def export(self, path: str | Path) -> Path:
        """Write the one-file artifact that ``grape_tvm.load`` reads."""
        return Artifact(self.manifest(), self.sections()).save(path)

    def sections(self) -> dict[str, bytes]:
        """The artifact's sections: the compiled library, then the cubins."""
        with tempfile.TemporaryDirectory(prefix="grape-export-") as tmp:
            lib = Path(tmp, "model.so")
            self.executable.export_library(str(lib))
            sections = {"library": lib.read_bytes()}
        sections.update({f"cubin/{k}": v for k, v in self.cubins.items()})
        return sections


def _relax_signature(func: relax.Function, dims: Mapping[str, ShapeRange],
                     output_names: list[str] | None) -> Signature:
    def spec(name: str, ty) -> TensorSpec:
        if not isinstance(ty, relax.TensorType) or ty.shape is None:
            raise TypeError(f"{name}: grape-tvm takes and returns tensors of known rank, got {ty}")
        shape = tuple(int(d) if isinstance(d, tvm.tirx.IntImm) else str(d) for d in ty.shape.values)
        return TensorSpec(name, str(ty.dtype), shape)

    inputs = tuple(spec(p.name, p.ty) for p in func.params)
    rets = list(func.ret_ty.fields) if isinstance(func.ret_ty, relax.TupleType) else [func.ret_ty]
    names = output_names or [f"output_{i}" for i in range(len(rets))]
    return Signature(inputs, tuple(spec(n, t) for n, t in zip(names, rets)), dict(dims))


def _cuda_sources(executable) -> list[str]:
    sources, stack = [], [executable.mod]
    while stack:
        mod = stack.pop()
        if mod.kind == "cuda":
            sources.append(mod.inspect_source(""))
        stack.extend(mod.imports)
    return sources


def _lower(mod: tvm.IRModule, tgt, ranges, select_ops: int = 16, matmul: str | None = None,
           device_branches: bool = True, weights: Sequence[int] = (),
           dependent_launch: bool = True) -> tvm.IRModule:
    try:
        return grape_pipeline(tgt, ranges, select_ops, device_branches, matmul, weights,
                              dependent_launch)(mod)
    except Exception as err:  # pylint: disable=broad-except
        # A Python pass's exception crosses TVM's FFI as a plain error carrying the text:
        # give the kernel check its own type back, so callers can catch it.
        text = str(err)
        if HostFallbackError.MARK in text:
            raise HostFallbackError(text[text.index(HostFallbackError.MARK):].splitlines()[0]) from None
        raise


def _check_planned_memory(lowered: tvm.IRModule, ranges: Mapping[str, ShapeRange],
                          max_memory: int, dim_names: Mapping[str, str]) -> None:
    planned = planned_bytes(lowered)
    if planned > max_memory:
        bounds = ", ".join(f"{dim_names.get(name, name)}={r.hi}" for name, r in ranges.items())
        where = f"at the declared upper bound {bounds}" if ranges else "for its static shapes"
        raise PlannedMemoryError(
            f"the memory planned {where} is {planned} bytes ({_in_units(planned)}), above the "
            f"limit of {max_memory} bytes ({_in_units(max_memory)}): every call would allocate "
            "it; declare a smaller range, or raise the limit (max_memory, --max-memory)")


def _in_units(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}" if unit != "B" else f"{size} B"
        size /= 1024
    return f"{size:.1f} TiB"


def build(mod: tvm.IRModule, dims: Mapping[str, Any] | None = None, target: Any = "llvm", *,
          signature: Signature | None = None, output_names: list[str] | None = None,
          prebuild_cubin: bool = True, select_ops: int = 16,
          device_branches: bool = True, max_memory: int = DEFAULT_MAX_MEMORY,
          dim_names: Mapping[str, str] | None = None, matmul: str | None = None,
          tensor_parallel: int = 1, weights: Sequence[str] = (),
          dependent_launch: bool = True) -> GrapeModule:
    """Compile a Relax module whose ``main`` takes tensors with symbolic dimensions.

    ``dims`` maps each symbolic dimension to its declared range ``(lo, hi)``; memory is
    planned at ``hi``, and every call allocates it: a range whose planned memory exceeds
    ``max_memory`` bytes (default 64 GiB) is refused (``PlannedMemoryError``, giving the
    bytes). A data-dependent ``if`` whose branches have at most ``select_ops``
    operators becomes a select (both computed); a larger one a conditional region (both
    launched, the one not taken disabled on the device); 0 makes every one conditional.
    ``device_branches=False`` leaves those to TVM's VM instead, which reads the condition on
    the host (a sync per call; the benchmarks' baseline). A build that fails with a select
    or a conditional region is made again without them (``_compile_with_fallbacks``: a
    warning, and a note in ``plan["notes"]``). For a CUDA target the kernels are compiled
    to cubin here when nvcc is present (else on first load, then cached). ``dim_names``
    maps a dim of ``mod`` to the name users know it by, where they differ
    (``frontend.with_identifier_dims``). ``matmul`` chooses what runs matmuls: "auto"
    (the default on CUDA: grape's GEMV kernels where the rows are few, cuBLASLt captured
    into the graphs above; the deployment host needs ``libcublasLt``), "cublaslt" (cuBLASLt
    at every row count), "grape" (grape's GEMV kernels for few rows, TVM's schedules above;
    CUDA) or "tvm" (TVM's schedules; the default elsewhere). ``tensor_parallel`` > 1: ``mod``
    carries sharding annotations for that many devices (``passes.tensor_parallel.shard``);
    the artifact holds the program each rank runs (its collectives ``R.ccl`` calls, for
    disco; each sharded input taken as the rank's part) and, in ``plan["tensor_parallel"]``,
    the world size, which inputs are split along which axis
    (``runtime.tensor_parallel.rank_inputs`` makes a rank's inputs from whole ones) and which
    outputs a rank holds a part of (``output_shard_plan``). A
    rank's matmuls go through ``matmul`` (``LowerTensorParallel`` makes them, their adds and
    GELUs Relax ops again at the rank's shapes): a column-parallel product with its bias, a
    row-parallel one alone, its bias and residual added after the all-reduce; its other ops
    are TVM's legalization, scheduled by grape's rules (no fused attention in a sharded
    build). ``weights``: inputs the caller binds once with ``bind_inputs`` (a model's
    weights); the build may take one in another layout, which the executor makes once as
    it binds it (a [K, N] matmul weight is read [N, K]: ``StoreWeightsTransposed``;
    ``plan["transposed_inputs"]`` names them), and such an input must then be bound, not
    passed to ``run``; a GEMV kernel may also load such a weight before the kernel it
    depends on has finished (``dependent_launch``). ``dependent_launch`` (CUDA, sm_90 and
    up): every kernel is launched while the one before it ends (programmatic dependent
    launch, ``passes.ProgrammaticDependentLaunch``); ``plan["dependent_launch"]`` says
    whether the build did.
    """
    tgt = parse_target(target)
    parallel = output_axes = None
    if tensor_parallel != 1:
        if weights:
            raise ValueError("weights= and tensor_parallel > 1 do not combine: a rank's "
                             "weights are its part of the whole ones (the shard plan)")
        mod, parallel, output_axes = _per_rank_program(mod, tensor_parallel)
    ranges = {k: ShapeRange.of(v, k) for k, v in (dims or {}).items()}
    signature = signature or _relax_signature(mod["main"], ranges, output_names)
    _check_weight_names(weights, signature)
    dim_names = dim_names or {}
    matmul = matmul_implementation(tgt, matmul)
    # By position: main's parameter names may differ from the signature's (the ONNX
    # importer makes identifiers of them, "h.0.weight" -> "h_0_weight").
    named = set(weights)
    executable, plan = _compile_with_fallbacks(
        mod, tgt, ranges, select_ops, device_branches, matmul,
        lambda lowered: _check_planned_memory(lowered, ranges, max_memory, dim_names),
        tuple(i for i, spec in enumerate(signature.inputs) if spec.name in named),
        dependent_launch)
    plan["transposed_inputs"] = [signature.inputs[i].name for i in plan["transposed_inputs"]]
    for region in plan["regions"]:
        region["symbolic_vars"] = [dim_names.get(v, v) for v in region["symbolic_vars"]]
    if parallel is not None:
        parallel[TENSOR_PARALLEL_OUTPUTS_KEY] = {
            spec.name: axis for spec, axis in zip(signature.outputs, output_axes)
            if axis is not None}
        plan[TENSOR_PARALLEL_KEY] = parallel
    return package(executable, signature, tgt, plan, prebuild_cubin=prebuild_cubin)


def _check_weight_names(weights: Sequence[str], signature: Signature) -> None:
    if isinstance(weights, str):
        raise TypeError(f"weights must be a list of input names, got the string {weights!r}")
    names = {t.name for t in signature.inputs}
    unknown = sorted(set(weights) - names)
    if unknown:
        raise ValueError(f"weights names {unknown}, which the model does not take: its inputs "
                         f"are {sorted(names)}")


def _per_rank_program(mod: tvm.IRModule,
                      world_size: int) -> tuple[tvm.IRModule, dict, list[int | None]]:
    """The program each of ``world_size`` ranks runs, the plan's tensor-parallel entry (its
    inputs' part), and the axis each output is split on (``_output_axes``)."""
    from grape_tvm.passes.tensor_parallel import (  # pylint: disable=import-outside-toplevel
        LocalParams, LowerTensorParallel, shard_plan)

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor_parallel must be a positive number of devices, got {world_size!r}")
    annotated = []
    relax.analysis.post_order_visit(mod["main"], lambda e: isinstance(e, relax.Call) and getattr(
        e.op, "name", "") == "relax.dist.annotate_sharding" and annotated.append(e))
    declared = mod.attrs.get("device_num") if mod.attrs is not None else None
    if not annotated or declared is None:
        raise ValueError(f"tensor_parallel={world_size}: the module carries no sharding "
                         "annotations for a device mesh (grape_tvm.passes.tensor_parallel's "
                         "shard and with_mesh make them)")
    if int(declared) != world_size:
        raise ValueError(f"tensor_parallel={world_size}: the module is annotated for "
                         f"{int(declared)} devices")
    per_rank = LocalParams()(LowerTensorParallel()(mod))
    return (per_rank, {"world_size": world_size, "shard_plan": shard_plan(per_rank)},
            _output_axes(mod["main"].ret_ty, per_rank["main"].ret_ty, world_size))


def _output_axes(whole, part, world_size: int) -> list[int | None]:
    """For each output of ``main`` (``whole``: its type on one device, ``part``: a rank's),
    the axis it is split on across the ranks, or None where a rank holds it whole."""
    wholes = list(whole.fields) if isinstance(whole, relax.TupleType) else [whole]
    parts = list(part.fields) if isinstance(part, relax.TupleType) else [part]
    if len(wholes) != len(parts):
        raise ValueError(f"main returns {len(wholes)} outputs on one device and {len(parts)} "
                         "on a rank")
    return [_split_axis(i, w, p, world_size) for i, (w, p) in enumerate(zip(wholes, parts))]


def _split_axis(index: int, whole, part, world_size: int) -> int | None:
    """The one axis output ``index`` is split on in ``world_size`` (static sizes, the rest
    equal), or None; anything else raises."""
    shaped = [isinstance(t, relax.TensorType) and t.shape is not None for t in (whole, part)]
    if not all(shaped):
        raise ValueError(f"output {index} is {whole} on one device and {part} on a rank: a "
                         "tensor-parallel output must be a tensor of known shape")
    split = []
    for axis, (a, b) in enumerate(zip(whole.shape, part.shape)):
        if isinstance(a, tvm.tirx.IntImm) and isinstance(b, tvm.tirx.IntImm):
            if int(a) != int(b):
                split.append(axis)
        elif not structural_equal(a, b):
            split.append(None)  # a symbolic size that differs: not a split this can name
    if len(whole.shape) != len(part.shape) or len(split) > 1 or None in split or any(
            int(whole.shape[a]) != world_size * int(part.shape[a]) for a in split):
        raise ValueError(f"output {index} is {whole} on one device and {part} on a rank: not "
                         f"one axis of static size split in {world_size}")
    return split[0] if split else None


def _has_if(mod: tvm.IRModule) -> bool:
    found = []
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(
                func, lambda e: found.append(e) if isinstance(e, relax.If) else None)
    return bool(found)


def _branch_modes(select_ops: int, device_branches: bool) -> list[tuple[int, bool]]:
    """The ways to build a module's ``if``s, the asked one first: grape's rewrites of them,
    then fewer of them (no selects; then no conditional regions: TVM's VM runs each ``if``)."""
    modes = [(select_ops, device_branches)]
    if select_ops > 0:
        modes.append((0, device_branches))
    if device_branches:
        modes.append((0, False))
    return modes


def _mode_name(select_ops: int, device_branches: bool) -> str:
    if select_ops:
        return f"select_ops={select_ops}"
    return ("select_ops=0 (every if a conditional region)" if device_branches
            else "select_ops=0, device_branches=False (TVM's VM runs every if)")


def _compile_with_fallbacks(mod: tvm.IRModule, tgt, ranges, select_ops: int,
                            device_branches: bool, matmul: str, check_lowered,
                            weights: Sequence[int] = (), dependent_launch: bool = True):
    """Lower and compile ``mod``: TVM's executable and grape's plan. A failure of a module
    with an ``if`` may be one of grape's rewrites of it (a select, a conditional region)
    that lowering or codegen cannot take: the build then tries again without them, warns,
    and notes it in the plan. Other errors, or one that every way raises, are the first
    way's; ``check_lowered(lowered)`` refuses a lowered module for good (its error is not
    the rewrites')."""
    modes = _branch_modes(select_ops, device_branches) if _has_if(mod) else \
        [(select_ops, device_branches)]
    notes, first = [], None
    for i, (ops, on_device) in enumerate(modes):
        try:
            lowered = _lower(mod, tgt, ranges, ops, matmul, on_device, weights, dependent_launch)
            check_lowered(lowered)
            plan = graph_plan(lowered).to_json()
            plan["notes"] += notes
            plan["matmul"] = matmul
            plan["dependent_launch"] = dependent_launch and supports_dependent_launch(tgt)
            return tvm.compile(lowered, target=tgt, relax_pipeline=None,
                               tir_pipeline=TIR_PIPELINE), plan
        except (HostFallbackError, PlannedMemoryError):
            raise
        except Exception as err:  # pylint: disable=broad-except
            first = first or err
            if i + 1 == len(modes):
                raise first from None
            text = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
            note = (f"the build with {_mode_name(ops, on_device)} failed ({text}); built "
                    f"again with {_mode_name(*modes[i + 1])}")
            warnings.warn(f"grape-tvm: {note}", stacklevel=3)
            notes.append(note)
    raise AssertionError("no way to build was tried")


def package(executable, signature: Signature, target: Any, plan: dict | None = None, *,
            prebuild_cubin: bool = True) -> GrapeModule:
    """A compiled executable as a ``GrapeModule``: with cubins for a CUDA target.

    Also packages executables built by TVM's own pipelines (the benchmarks' baselines):
    their plan has no regions, so grape's executor runs them exactly as TVM's VM would.
    """
    tgt = parse_target(target)
    info = target_json(tgt)
    cubins = {}
    if is_gpu(tgt) and prebuild_cubin and nvcc_available():
        # The model's kernels and the runtime's own (patch, loop, attention's if called), for
        # the target's arch.
        sources = _cuda_sources(executable) + [PATCH_SOURCE.read_text(), LOOP_SOURCE.read_text()]
        sources += [source.read_text()
                    for source in attention_sources_of((plan or {}).get("libraries", ()))]
        cubins = {source_key(code): compile_cubin(code, info.get("arch", "sm_90"))
                  for code in sources}
    plan = plan if plan is not None else {"regions": [], "host_steps": [], "host_bookkeeping": 0}
    return GrapeModule(executable, signature, plan, info, cubins)


def _check_step(main: relax.Function, carried: Sequence[str], stop: str) -> None:
    params = {p.name: p for p in main.params}
    unknown = [n for n in carried if n not in params]
    if unknown:
        raise ValueError(f"carried state {unknown} are not inputs of the step; it takes "
                         f"{list(params)}")
    if len(set(carried)) != len(carried) or stop in carried:
        raise ValueError(f"carried names must be distinct and differ from stop {stop!r}")
    rets = list(main.ret_ty.fields) if isinstance(main.ret_ty, relax.TupleType) else [main.ret_ty]
    if len(rets) != len(carried) + 1:
        raise ValueError(f"the step must return the next value of each carried input "
                         f"({len(carried)}) and then the stop flag: it returns {len(rets)} values")
    for name, ret in zip(carried, rets):
        want = params[name].ty
        if not structural_equal(want, ret):
            raise ValueError(f"the step's next {name!r} is {ret}, but {name!r} is {want}: "
                             "loop state keeps its shape and dtype")
    if str(rets[-1].dtype) not in STOP_DTYPES:
        raise ValueError(f"stop {stop!r} has dtype {rets[-1].dtype}; expected one of "
                         f"{STOP_DTYPES} (the loop stops when any element is non-zero)")


def compile_loop(step: tvm.IRModule, carried: Sequence[str], *, max_steps: int,
                 stop: str = "stop", dims: Mapping[str, Any] | None = None,
                 target: Any = "llvm", **kwargs) -> GrapeModule:
    """Compile a step function for ``load_loop`` (``grape_tvm.loop``): a ``GrapeModule``
    whose manifest says which inputs are the loop state (``carried``, in the order of the
    step's outputs), the name of the stop output (the step's last output) and the default
    step limit. ``kwargs`` go to ``build``; ``tensor_parallel=N`` compiles a step annotated
    for N devices into the loop every rank runs (``TensorParallelSession.run_loop``), its
    state split as the plan says (``_check_rank_loop``)."""
    if int(max_steps) < 1:
        raise ValueError(f"max_steps must be at least 1, got {max_steps}")
    _check_step(step["main"], carried, stop)
    state_as_weights = sorted(set(kwargs.get("weights", ())) & set(carried))
    if state_as_weights:
        raise ValueError(f"weights {state_as_weights} are loop state, which changes every step: "
                         "weights are the invariants, bound once")
    module = build(step, dims, target, output_names=[*carried, stop], **kwargs)
    if TENSOR_PARALLEL_KEY in module.plan:
        _check_rank_loop(module.plan[TENSOR_PARALLEL_KEY], carried, stop)
    module.loop = LoopSpec(tuple(carried), stop, int(max_steps)).to_json()
    return module


def _check_rank_loop(parallel: Mapping[str, Any], carried: Sequence[str], stop: str) -> None:
    """Refuse a tensor-parallel step whose loop the ranks could not each run: every rank
    reads its own ``stop`` after each step and ends its loop there, so ``stop`` must be
    held whole on every rank, which makes it replicated (TVM's placements are replicated or
    split): computed by the same kernels from replicated values, the same flag on every
    rank. A split one could stop the ranks at different steps, the others then waiting in
    a collective for ever. And each carried value must come out of a rank as the part that
    rank takes in (split along the same axis, or whole on both sides)."""
    inputs, outputs = parallel["shard_plan"], parallel[TENSOR_PARALLEL_OUTPUTS_KEY]
    if stop in outputs:
        raise ValueError(f"stop {stop!r} is split across the ranks (axis {outputs[stop]}): "
                         "every rank must read the same stop flag, so compute it from "
                         "replicated values (after an all-reduce)")
    for name in carried:
        taken, given = inputs.get(name), outputs.get(name)
        if taken != given:
            raise ValueError(f"carried {name!r} is taken {placement_text(taken)} and its next "
                             f"value comes out {placement_text(given)} on a rank: a rank's loop "
                             "state must stay its own part (annotate both alike)")

