"""Programmatic dependent launch (sm_90+): each kernel launched while the one before it ends."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import tvm
from tvm import IRModule, ir, relax, s_tir, tirx
from tvm.ir import GenericConst, Op
from tvm.ir.transform import PassContext, module_pass
from tvm.script import tirx as T
from tvm_ffi.structural import structural_mutate, structural_walk

from .kernel_attributes import coherent_loads_mark, min_blocks_mark

# TVM's launch-parameter tag (src/runtime/metadata.h, spelled as TVM spells it): its CUDA
# module launches a kernel carrying it with programmatic stream serialization.
PDL_LAUNCH_TAG = "tirx.use_programtic_dependent_launch"
KERNEL_LAUNCH_PARAMS = "tirx.kernel_launch_params"
MIN_ARCH = 90  # griddepcontrol: PTX ISA 7.8, sm_90
# Block annotation of a schedule rule: this block, first in its kernel, reads only the
# model's weights, and may run before the wait (a GEMV's weights into registers).
WEIGHTS_FIRST = "grape_weights_before_wait"
# The minimum of blocks an SM (``__launch_bounds__``) of a kernel that loads its weights
# before the wait; 0: none. On the H200, in chains of GEMVs read from HBM
# (bench/results/gemv_chain.json, coherent loads), this minimum of two took 0.89x to 1.05x
# the time of no minimum at M = 1 and 0.74x to 1.04x at M = 8, and 0.97x to 1.01x and 0.78x
# to 1.04x the time of a minimum of one.
WEIGHTS_HELD_MIN_BLOCKS = 2
_CALL_TIR = Op.get("relax.call_tir")
_CALL_TIR_INPLACE = Op.get("relax.call_tir_inplace")


def supports_dependent_launch(target: tvm.target.Target) -> bool:
    """Whether ``target`` is CUDA of an architecture with griddepcontrol (sm_90 and up)."""
    if target.kind.name != "cuda" or "arch" not in target.attrs:
        return False
    arch = str(target.attrs["arch"])
    digits = "".join(c for c in arch.split("_")[-1] if c.isdigit())
    return bool(digits) and int(digits) >= MIN_ARCH


def _launch_dependents() -> tirx.Stmt:
    # Let the next kernel launch now: its blocks take the SMs this grid leaves free, and
    # wait there.
    return tirx.Evaluate(T.ptx.griddepcontrol.launch_dependents())


def _wait() -> tirx.Stmt:
    # Until every kernel this one depends on has finished and its writes are visible.
    return tirx.Evaluate(T.ptx.griddepcontrol.wait())


def _fence() -> tirx.Stmt:
    # membar.cta: ptxas keeps the kernel's ld.global.nc loads below it, where it schedules
    # them freely around the wait alone (see ProgrammaticDependentLaunch).
    return tirx.Evaluate(tirx.call_extern("void", "__threadfence_block"))


def _with_loop_body(loop: tirx.For, body: tirx.Stmt) -> tirx.For:
    return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding,
                    loop.annotations, loop.step, loop.span)


def _weights_only(stmt: tirx.Stmt) -> bool:
    """Whether every block under ``stmt`` is a ``WEIGHTS_FIRST`` block (and there is one)."""
    marked, other = [], []

    def on_block(block):
        (marked if WEIGHTS_FIRST in block.annotations else other).append(block)

    structural_walk(stmt, ((s_tir.SBlock, on_block),))
    return bool(marked) and not other


def _wait_after_weights(body: tirx.Stmt) -> tirx.Stmt | None:
    """``body`` (a kernel's, inside its outermost thread binding) with the wait right after
    the loads of its weights, where they come first: the first statement of the kernel
    (through thread bindings and the first statements of sequences) holds only
    ``WEIGHTS_FIRST`` blocks. None otherwise."""
    if isinstance(body, tirx.For) and body.thread_binding is not None:
        inner = _wait_after_weights(body.body)
        return None if inner is None else _with_loop_body(body, inner)
    if isinstance(body, tirx.SeqStmt) and len(body.seq) > 1:
        first, *rest = body.seq
        if _weights_only(first):
            return tirx.SeqStmt([first, _wait(), *rest])
        inner = _wait_after_weights(first)
        return None if inner is None else tirx.SeqStmt([inner, *rest])
    return None


def _with_prologue(body: tirx.Stmt, weights_first: bool) -> tuple[tirx.Stmt, int]:
    """``body`` with each kernel's outermost thread binding starting with
    ``launch_dependents``, then the wait and a fence, or, where ``weights_first`` and the
    kernel loads its weights first, those loads then the wait (the kernel then marked for
    coherent loads and its minimum of blocks an SM), and the number of kernels."""
    kernels = 0

    def on_for(loop, mutator):
        nonlocal kernels
        if loop.thread_binding is None:
            return mutator.default_mutate(loop)
        kernels += 1
        held = _wait_after_weights(loop.body) if weights_first else None
        if held is None:
            waits_first = tirx.SeqStmt([_wait(), _fence(), loop.body])
            return _with_loop_body(loop, tirx.SeqStmt([_launch_dependents(), waits_first]))
        body = coherent_loads_mark(tirx.SeqStmt([_launch_dependents(), held]))
        if WEIGHTS_HELD_MIN_BLOCKS:
            body = min_blocks_mark(WEIGHTS_HELD_MIN_BLOCKS, body)
        return _with_loop_body(loop, body)

    return structural_mutate(body, ((tirx.For, on_for),)), kernels


def _weight_parameter(func: tirx.PrimFunc) -> int | None:
    """The position of the parameter a ``WEIGHTS_FIRST`` block reads, if any."""
    sources = []

    def on_block(block):
        if WEIGHTS_FIRST in block.annotations:
            sources.extend(r.source for r in block.reads)

    structural_walk(func.body, ((s_tir.SBlock, on_block),))
    # one per kernel of the PrimFunc (a kernel per bucket of rows): the same parameter
    matched = [i for b in sources for i, p in enumerate(func.params) if b.same_as(p)]
    if not sources or len(matched) != len(sources) or len(set(matched)) != 1:
        return None
    return matched[0]


@dataclass
class _RelaxUses:
    """One walk of a module's Relax functions: its kernel calls (``call_tir`` and
    ``call_tir_inplace``), and how often each variable and GlobalVar occurs in them."""

    calls: list = field(default_factory=list)
    vars: Counter = field(default_factory=Counter)
    gvars: Counter = field(default_factory=Counter)

    @classmethod
    def of(cls, mod: IRModule) -> "_RelaxUses":
        uses = cls()

        def on_call(call):
            if call.op.same_as(_CALL_TIR) or call.op.same_as(_CALL_TIR_INPLACE):
                uses.calls.append(call)

        def on_var(var):
            uses.vars[var] += 1

        def on_gvar(gvar):
            uses.gvars[gvar] += 1

        for func in mod.functions.values():
            if isinstance(func, relax.Function):
                # TVM objects hash and compare by the node they hold: a Var met twice is
                # one key
                structural_walk(func.body, ((relax.Call, on_call), (relax.Var, on_var),
                                            (ir.GlobalVar, on_gvar)))
        return uses


def _call_args(call) -> list:
    return list(call.args[1].fields) if isinstance(call.args[1], relax.Tuple) else [call.args[1]]


def _read_only_args(call) -> list:
    """The arguments a kernel call only reads (``call_tir_inplace`` writes some)."""
    written = {int(i) for i in call.attrs.inplace_indices} \
        if call.op.same_as(_CALL_TIR_INPLACE) else set()
    return [a for i, a in enumerate(_call_args(call)) if i not in written]


def _weights_of(mod: IRModule, bound: frozenset[int], uses: _RelaxUses) -> set:
    """What a kernel may read before its wait: the parameters of ``main`` at the positions
    ``bound`` (weights the caller binds once) that the module uses only as read-only
    arguments of kernel calls. A weight bound to another variable, viewed, passed to
    another function or a packed call, or written in place, is left out: following its
    aliases is not worth the risk."""
    main = next((f for g, f in mod.functions_items() if g.name_hint == "main"
                 and isinstance(f, relax.Function)), None)
    weights = [] if main is None else [p for i, p in enumerate(main.params) if i in bound]
    reads = Counter(a for call in uses.calls for a in _read_only_args(call) if a in weights)
    return {w for w in weights if uses.vars[w] == reads[w]}


def _reads_weights_only(weight_position: dict, weights: set, uses: _RelaxUses) -> set:
    """The PrimFuncs (by GlobalVar) whose ``WEIGHTS_FIRST`` parameter (``weight_position``)
    is, at every call, a constant or one of ``weights``, and that are used only as the
    callee of kernel calls (another use has no call to check)."""
    callee, unsafe = Counter(), set()
    for call in uses.calls:
        gvar = call.args[0]
        position = weight_position.get(gvar)
        if position is None:
            continue
        callee[gvar] += 1
        args = _call_args(call)
        arg = args[position] if position < len(args) else None
        if not (isinstance(arg, GenericConst) or arg in weights):
            unsafe.add(gvar)
    return {g for g in weight_position if callee[g] and callee[g] == uses.gvars[g]
            and g not in unsafe}


def _launches_by_attribute(func: tirx.PrimFunc) -> bool:
    """Whether a kernel of ``func`` is written as a ``thread_extent`` attribute
    (``T.launch_thread``, TOPI's ir_builder kernels), where the prologue is not put."""
    found = []

    def on_attr(stmt):
        if stmt.attr_key == "thread_extent":
            found.append(stmt)

    structural_walk(func.body, ((tirx.AttrStmt, on_attr),))
    return bool(found)


@module_pass(opt_level=0, name="ProgrammaticDependentLaunch")
class ProgrammaticDependentLaunch:
    """Launch every scheduled kernel with programmatic stream serialization (sm_90+).

    A decode step is a chain of small kernels, each waiting for the one before: between two
    of them the GPU spends the second's launch and block scheduling, idle. With programmatic
    dependent launch the next kernel's blocks are launched while the current kernel runs and
    wait on the SM (``griddepcontrol.wait``) for it to finish; captured into a CUDA graph,
    the dependency becomes a programmatic edge. Every kernel of a scheduled PrimFunc gets
    the prologue below first inside its outermost thread binding, and the PrimFunc TVM's
    launch tag (its CUDA module then launches through ``cuLaunchKernelEx`` with
    ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``)::

        # before
        @T.prim_func
        def add_one(A: T.Buffer((1024,), "float32"), B: T.Buffer((1024,), "float32")):
            for bx in T.thread_binding(8, thread="blockIdx.x"):
                for tx in T.thread_binding(128, thread="threadIdx.x"):
                    B[bx * 128 + tx] = A[bx * 128 + tx] + T.float32(1)

        # after
        @T.prim_func
        def add_one(A: T.Buffer((1024,), "float32"), B: T.Buffer((1024,), "float32")):
            T.func_attr({"tirx.kernel_launch_params": ["tirx.use_programtic_dependent_launch"]})
            for bx in T.thread_binding(8, thread="blockIdx.x"):
                T.ptx.griddepcontrol.launch_dependents()
                T.ptx.griddepcontrol.wait()
                T.call_extern("void", "__threadfence_block")
                for tx in T.thread_binding(128, thread="threadIdx.x"):
                    B[bx * 128 + tx] = A[bx * 128 + tx] + T.float32(1)

    Safe whatever runs around the kernel: the wait comes before any memory access, and
    holds until every grid the kernel depends on has completed and flushed, so a
    dependency on a kernel launched without the attribute (a library's) or on a copy is
    kept as it was. A kernel launched after this one without the attribute waits for its
    completion as usual. PrimFuncs without a thread binding (host functions, library calls)
    are left as they are, and so are PrimFuncs with a kernel written as a ``thread_extent``
    attribute (``T.launch_thread``). Only for CUDA targets of sm_90 and up: the
    instructions do not exist below.

    "Before any memory access" has to hold in SASS, where ptxas (nvcc 13.0, sm_90) schedules
    the wait (``ACQBULK``) freely around the ``ld.global.nc`` loads nvcc makes of reads
    through TVM's ``__restrict__`` pointers that a kernel never writes: in a GEMV kernel of
    a few rows it put a load of the kernel before's output above the wait (``ld.global.nc``
    also promises data that does not change while the kernel runs, which a kernel before
    that has not ended does not keep). A fence after the wait (``__threadfence_block``,
    ``membar.cta``: nothing is in flight to wait for) keeps them below it; coherent loads
    everywhere did too, but cost GPT-2's prefill about 185 us a call on the H200, fp32 and
    fp16 (bench/README.md, 12-04 second session). Both are what ptxas was seen to do, not
    PTX guarantees: tests/test_dependent_launch.py reads the SASS with ``nvdisasm``.

    One exception to "wait first": a kernel whose schedule loads the model's weights first,
    in a block marked ``WEIGHTS_FIRST`` (``DecodeGemv``'s and ``GemvForFewRows``'s GEMV
    kernels, those computing a row norm first among them), waits right after
    those loads, which are then in flight while the kernel before it ends. Such a kernel is
    marked (``kernel_attributes.coherent_loads_mark``) for pointer parameters without
    ``__restrict__``: with ``.nc`` loads ptxas put the wait above every weight load, whatever
    the PTX's order; coherent loads, weights' and activations', it keeps on their side. It
    also asks for a minimum of ``WEIGHTS_HELD_MIN_BLOCKS`` blocks an SM. Only where
    nothing the call runs writes them: at every call of the PrimFunc, the marked block's
    buffer is a constant or a parameter of ``main`` at a position of ``weights`` (bound
    once by the caller) that the module only passes to kernels as a read-only argument.
    A weight the call computes, or an input passed with every call (its producer may be
    the kernel right before), is read after the wait. Inside a CUDA graph the first
    kernel waits for all work queued before the graph; outside one (TVM's VM running a
    call), a kernel on the executor's stream that writes a bound weight right before a
    call would race these loads.
    """

    def __init__(self, target: tvm.target.Target | None = None, weights: Sequence[int] = ()):
        self.target = target
        self.weights = frozenset(weights)  # positions of main's parameters bound once

    def transform_module(self, mod: IRModule, _ctx: PassContext) -> IRModule:
        target = self.target or tvm.target.Target.current(allow_none=True)
        if target is None or not supports_dependent_launch(target):
            return mod
        positions = {gvar: _weight_parameter(func) for gvar, func in mod.functions_items()
                     if isinstance(func, tirx.PrimFunc)}
        positions = {g: p for g, p in positions.items() if p is not None}
        uses = _RelaxUses.of(mod)
        weights_first = _reads_weights_only(positions, _weights_of(mod, self.weights, uses),
                                            uses)
        updated = {}
        for gvar, func in mod.functions_items():
            # a PrimFunc with a kernel the prologue cannot reach launches as it was: its
            # tag would launch that kernel early with no wait in it
            if not isinstance(func, tirx.PrimFunc) or _launches_by_attribute(func):
                continue
            body, kernels = _with_prologue(func.body, gvar in weights_first)
            if kernels == 0:
                continue
            tags = list(func.attrs.get(KERNEL_LAUNCH_PARAMS, []) if func.attrs else [])
            if PDL_LAUNCH_TAG not in tags:
                tags.append(PDL_LAUNCH_TAG)
            updated[gvar] = func.with_body(body).with_attr(KERNEL_LAUNCH_PARAMS, tags)
        if not updated:
            return mod
        # a new module: the caller's is left as it was
        return IRModule({g: updated.get(g, f) for g, f in mod.functions_items()},
                        attrs=mod.attrs, global_infos=mod.global_infos)
