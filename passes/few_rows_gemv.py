"""A library matmul with few rows runs on grape's GEMV kernels, and on the library above."""

from __future__ import annotations

import dataclasses
import math

import tvm
from tvm import IRModule, relax, s_tir, te, tirx
from tvm.ir import Op
from tvm.ir.expr import TensorLoad
from tvm.ir.transform import PassContext, module_pass
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline_contiguous_spatial
from tvm_ffi.structural import structural_map, structural_walk

from grape_tvm.runtime.cublaslt import MATMUL_FUNCTIONS, MatmulFunction

from .gemv_schedule import gemv_by_rows, gemv_config, match_gemv, schedule_gemv
from .if_to_select import same_dims
from .var_reads import emit_as, read_counts

# The buckets of rows (M) grape's GEMV kernels take, by weight layout; the library takes M
# above. Measured on the H200 in grape's graphs (bench/results/matmul.json, GPT-2's five
# shapes, fp32 and fp16): at M = 1 grape's kernels take 0.37x to 0.90x cuBLASLt's time for a
# weight stored [N, K] and 0.52x to 1.18x for [K, N]; at M = 8, 0.41x to 1.19x for [N, K]
# but 0.65x to 4.28x for [K, N]. So [K, N] stops at one row.
GEMV_ROWS = {"nk": (1, 2, 4, 8), "kn": (1,)}
# On a PrimFunc this pass made: the library function that runs M above its GEMV buckets
# (``LiftGraphRegions`` names the launch by it, and the runtime must provide it), and the
# buckets (the plan's ``gemv_rows``, which ``inspect`` reads).
LIBRARY_FUNCTION_ATTR = "grape.library_function"
GEMV_ROWS_ATTR = "grape.gemv_rows"

_CALL_DPS_PACKED = Op.get("relax.call_dps_packed")
_CALL_TIR = Op.get("relax.call_tir")
_CALL_TIR_INPLACE = Op.get("relax.call_tir_inplace")
_GELU_SCALE = math.sqrt(2 / math.pi)


def _library_call(call: relax.Call) -> MatmulFunction | None:
    """The weight matmul a ``call_dps_packed`` runs, or None for any other call."""
    if not isinstance(call, relax.Call) or call.op != _CALL_DPS_PACKED:
        return None
    callee = call.args[0]
    if not isinstance(callee, relax.ExternFunc):
        return None
    function = MATMUL_FUNCTIONS.get(str(callee.global_symbol))
    return function if function is not None and not function.batched else None


def _fresh_dims(dims) -> list | None:
    """``dims`` with each symbolic dim a new variable of the PrimFunc (None where a dim is
    an expression: no single row count to dispatch on)."""
    fresh: dict = {}
    out = []
    for d in dims:
        if isinstance(d, tirx.IntImm):
            out.append(int(d))
        elif isinstance(d, tirx.Var):
            out.append(fresh.setdefault(d.name, tirx.Var(d.name, d.ty)))
        else:
            return None
    return out


def _gelu_tanh(v):
    return 0.5 * v * (1.0 + tirx.tanh(_GELU_SCALE * (v + 0.044715 * v * v * v)))


def matmul_prim_func(function: MatmulFunction, rows: list, k: int, n: int,
                     dtype: str, activation=None) -> tirx.PrimFunc:
    """What ``function`` computes, as a PrimFunc: ``out[rows.., n] = epilogue(sum_k x[rows..,
    k] w[k, n] (+ residual) (+ bias))``, summed and finished in fp32 and rounded once, as
    cuBLASLt does (w[n, k] where the weight is transposed), then ``activation`` (a scalar
    function of the rounded value, ``unary_elementwise``) where given. Parameters in the
    packed function's order: x, w, bias, residual, out."""
    acc = "float32"
    # int64 throughout, as Relax's legalization makes them: the schedules index in one dtype
    rows = [tirx.IntImm("int64", r) if isinstance(r, int) else r for r in rows]
    k, n = tirx.IntImm("int64", k), tirx.IntImm("int64", n)
    x = te.placeholder((*rows, k), dtype, "x")
    w = te.placeholder((n, k) if function.transposed_weight else (k, n), dtype, "w")
    bias = te.placeholder((n,), dtype, "bias") if function.has_bias else None
    residual = te.placeholder((*rows, n), dtype, "residual") if function.residual else None
    r = te.reduce_axis((tirx.IntImm("int64", 0), k), name="k")

    def product(*i):
        weight = w[i[-1], r] if function.transposed_weight else w[r, i[-1]]
        return te.sum(x[(*i[:-1], r)].astype(acc) * weight.astype(acc), axis=r)

    summed = te.compute((*rows, n), product, name="matmul")

    def finish(*i):
        v = summed(*i)
        if residual is not None:
            v = v + residual(*i).astype(acc)
        if bias is not None:
            v = v + bias[i[-1]].astype(acc)
        if "gelu" in function.epilogue:
            v = _gelu_tanh(v)
        return v.astype(dtype) if activation is None else activation(v.astype(dtype))

    out = te.compute((*rows, n), finish, name="epilogue")
    params = [t for t in (x, w, bias, residual, out) if t is not None]
    return te.create_prim_func(params)


def unary_elementwise(func: tirx.PrimFunc):
    """The scalar function a PrimFunc of one input and one output of the same shape applies
    element by element (one store, of loads of the input at the store's own indices; a
    GELU, as TVM legalizes and schedules ``nn.gelu``), as a function of a TIR value; else
    None."""
    if len(func.params) != 2:
        return None
    source, output = func.params
    if not same_dims(source.shape, output.shape) or source.dtype != output.dtype:
        return None
    stores, loads = [], []
    structural_walk(_inlined(func).body, ((tirx.BufferStore, stores.append),))
    if len(stores) != 1 or not stores[0].buffer.same_as(output):
        return None
    store = stores[0]
    structural_walk(store.value, ((TensorLoad, loads.append),))
    if not loads or any(not load.source.same_as(source) or
                        not all(a.same_as(b) for a, b in zip(load.indices, store.indices))
                        for load in loads):
        return None
    # A value that uses the element's position (tril's) or a dim besides the loads is no
    # scalar function: its variables would be unbound in the matmul's kernel.
    variables = []
    structural_walk(structural_map(store.value, (TensorLoad, lambda _: tirx.const(0.0))),
                    ((tirx.Var, variables.append),))
    if variables:
        return None
    return lambda value: structural_map(store.value, (TensorLoad, lambda _: value))


def _inlined(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with its spatial blocks inlined into the last (as legalized, a GELU is
    several blocks); itself where that fails."""
    try:
        sch = s_tir.Schedule(func)
        try_inline_contiguous_spatial(sch, normalize_prim_func(sch))
        return sch.mod["main"]
    except (s_tir.ScheduleError, tvm.error.InternalError):
        return func  # a body dlight cannot inline: read as it is


def _in_place(activation, out: tirx.Var, threads: int = 256) -> tirx.Stmt:
    """A kernel applying ``activation`` to ``out`` (a PrimFunc's buffer parameter) in
    place: the library's result, where the GEMV kernels fuse it."""
    source = te.placeholder(out.shape, out.dtype, "source")
    applied = te.compute(source.shape, lambda *i: activation(source(*i)), name="activation")
    sch = s_tir.Schedule(te.create_prim_func([source, applied]))
    block = sch.get_sblock("activation")
    grid, lanes = sch.split(sch.fuse(*sch.get_loops(block)), [None, threads])
    sch.bind(grid, "blockIdx.x")
    sch.bind(lanes, "threadIdx.x")
    kernel = sch.mod["main"]
    ends = set(kernel.params)
    return structural_map(kernel.body, (tirx.Var, lambda v: out if v in ends else v))


def few_rows_gemv(function: MatmulFunction, func: tirx.PrimFunc,
                  target: tvm.target.Target, activation=None,
                  norm: tirx.PrimFunc | None = None) -> tirx.PrimFunc | None:
    """``func`` (``matmul_prim_func``) as GEMV kernels for the rows of ``GEMV_ROWS`` and a
    call of the library function above them (and at M = 0: it launches nothing, where a
    kernel of 0 blocks would fail), chosen on the host; None where the GEMV rule does not
    take it. Static rows within the buckets: one GEMV kernel, no library. ``activation``
    (``func``'s, applied after its epilogue): a kernel of its own after the library's.
    ``norm``: a row norm before it (``_after_norm``)."""
    shape = match_gemv(func)
    if shape is None:
        return None
    if norm is not None:
        scheduled = _after_norm(function, func, shape, norm, target, activation)
    else:
        # the parameters are buffers: passed to the packed function as DLTensors
        library = func.with_body(tirx.Evaluate(tirx.call_packed(function.name, *func.params)))
        above = library if activation is None else library.with_body(
            tirx.SeqStmt([library.body, _in_place(activation, func.params[-1])]))
        scheduled = gemv_by_rows(func, shape, GEMV_ROWS[shape.layout], target, default=above,
                                 before=((0, library),))
    if scheduled is None:
        return None
    attrs = {"tirx.is_scheduled": True}
    if shape.symbolic:
        attrs.update({LIBRARY_FUNCTION_ATTR: function.name,
                      GEMV_ROWS_ATTR: list(GEMV_ROWS[shape.layout])})
    # its name comes from the module it joins (AttachGlobalSymbol), not te's "main"
    return scheduled.without_attr("global_symbol").with_attrs(attrs)


def _after_norm(function: MatmulFunction, func: tirx.PrimFunc, shape, norm: tirx.PrimFunc,
                target: tvm.target.Target, activation) -> tirx.PrimFunc | None:
    """``few_rows_gemv`` of ``func`` whose x is ``norm``'s output (a ``row_norm``), as one
    PrimFunc taking the norm's inputs, ``func``'s but x, then the norm's output (written
    where the library or a GEMV kernel of several rows reads it) and ``func``'s.

    One row: a GEMV kernel that normalizes its row itself (``schedule_gemv``'s prologue).
    2 to 8 rows: the norm's kernel, then the GEMV kernel (on the H200 the prologue cost a
    kernel of 8 rows more than the norm's kernel: bench/README.md, 2026-12-03). Above: the
    norm's kernel, then the library. None where the prologue does not fit the norm."""
    try:
        return _norm_then_gemv(function, func, shape, norm, target, activation)
    except (ValueError, s_tir.ScheduleError, tvm.error.InternalError):
        return None  # a norm the prologue cannot take: it stays a kernel of its own


def _norm_then_gemv(function: MatmulFunction, func: tirx.PrimFunc, shape,
                    norm: tirx.PrimFunc, target: tvm.target.Target, activation):
    composed = compose_after(norm, func)
    inputs = composed.params[:len(norm.params) - 1]
    rest = composed.params[len(norm.params) - 1:]  # func's but x: w, bias, residual, out
    out = rest[-1]  # its rows are the composed function's dims (FuseTIR's)
    rows = dict(zip(func.params[-1].shape, out.shape)).get(shape.rows, shape.rows)
    normed = tirx.decl_buffer([*out.shape[:-1], func.params[0].shape[-1]],
                              func.params[0].dtype, "normed")
    signature = tirx.PrimFunc([*inputs, *rest[:-1], normed, out], tirx.Evaluate(0),
                              attrs=composed.attrs)
    alone = scheduled_alone(norm, target)
    if alone is None:
        return None

    def norm_kernel() -> tirx.Stmt:  # a copy of its own each time: one definition a buffer
        fresh = s_tir.renew_defs(alone)
        return _with_params(fresh, dict(zip(fresh.params, [*inputs, normed])))

    def bucket(size: int) -> tirx.PrimFunc:
        if size == 1:
            one_row = dataclasses.replace(shape, rows=rows)
            body = schedule_gemv(composed, one_row, gemv_config(shape, 1), prologue=True)
            return signature.with_body(body.mod["main"].body)
        kernel = schedule_gemv(func, shape, gemv_config(shape, size)).mod["main"]
        return signature.with_body(tirx.SeqStmt([
            norm_kernel(), _with_params(kernel, dict(zip(kernel.params, [normed, *rest])))]))

    library = tirx.Evaluate(tirx.call_packed(function.name, normed, *rest))
    above = [norm_kernel(), library] + ([] if activation is None else [_in_place(activation, out)])
    return gemv_by_rows(signature, dataclasses.replace(shape, rows=rows), GEMV_ROWS[shape.layout],
                        target, default=signature.with_body(tirx.SeqStmt(above)),
                        before=((0, signature.with_body(library)),), kernel=bucket)


def row_norm(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` normalizes rows: its output [rows.., K] written by an element-wise
    block from its inputs and reductions of them over K per row (a layer norm or an RMS
    norm, as TVM legalizes them: sums, then the output)."""
    if len(func.params) < 2 or not all(isinstance(p.ty, tirx.BufferType) for p in func.params):
        return False  # a dim passed as a scalar too (``tir_vars``): not a plain kernel of tensors
    if len(func.params[-1].shape) < 1:
        return False  # a 0-d output: no rows
    try:
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or not infos[-1].is_injective():
            return False
        if not sch.get(infos[-1].block_rv).writes[0].source.same_as(func.params[-1]):
            return False
        stats = try_inline_contiguous_spatial(sch, infos[:-1])
    except (s_tir.ScheduleError, tvm.error.InternalError):
        return False
    width = func.params[-1].shape[-1]
    return bool(stats) and all(
        "".join(i.kind for i in info.iters[:-1]) == "S" * (len(info.iters) - 1)
        and info.iters[-1].kind == "R" and same_dims([info.iters[-1].dom], [width])
        for info in stats)


def compose_after(first: tirx.PrimFunc, then: tirx.PrimFunc) -> tirx.PrimFunc:
    """One PrimFunc: ``first`` (its output the last parameter), then ``then`` reading that
    output as its first parameter, an internal buffer between them (TVM's FuseTIR). Its
    parameters: ``first``'s inputs, then ``then``'s but the first."""
    builder = relax.BlockBuilder()
    first_gvar, then_gvar = builder.add_func(first, "first"), builder.add_func(then, "then")
    # one set of dims: ``then``'s as ``first``'s output has them (FuseTIR binds a PrimFunc's
    # dims from its arguments' types)
    dims = {a: b for a, b in zip(then.params[0].shape, first.params[-1].shape)
            if isinstance(a, tirx.Var)}

    def ty(buffer):
        shape = [structural_map(d, (tirx.Var, lambda v: dims.get(v, v))) for d in buffer.shape]
        return relax.TensorType(shape, buffer.dtype)

    inputs = [relax.Var(p.name, ty(p)) for p in first.params[:-1]]
    rest = [relax.Var(p.name, ty(p)) for p in then.params[1:-1]]
    with builder.function("fused", [*inputs, *rest], attrs={"Primitive": True}, private=True):
        with builder.dataflow():
            mid = builder.emit(relax.call_tir(first_gvar, inputs, ty(first.params[-1])))
            out = builder.emit_output(relax.call_tir(then_gvar, [mid, *rest], ty(then.params[-1])))
        builder.emit_func_output(out)
    fused = builder.get().get_global_var("fused")
    outer = [relax.Var(p.name, p.ty) for p in [*inputs, *rest]]
    with builder.function("main", outer):
        builder.emit_func_output(builder.emit(relax.Call(fused, outer)))
    return relax.transform.FuseTIR()(builder.get())["fused"]


def scheduled_alone(func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """``func`` scheduled by the GPU rules, as the pipeline would have (None where none
    takes it)."""
    from .gpu_schedules import default_gpu_rules  # pylint: disable=import-outside-toplevel

    mod = tvm.IRModule({"main": func})
    with target:
        mod = s_tir.dlight.ApplyDefaultSchedule(*default_gpu_rules(False))(mod)
    scheduled = mod["main"]
    return scheduled if scheduled.attrs and scheduled.attrs.get("tirx.is_scheduled") else None


def _with_params(func: tirx.PrimFunc, params: dict) -> tirx.Stmt:
    """``func``'s body with its parameters (buffers) and the dims of their shapes replaced
    by those ``params`` maps them to."""
    mapping = dict(params)
    for old, new in params.items():
        for a, b in zip(old.shape, new.shape):
            if isinstance(a, tirx.Var):
                mapping[a] = b
    return structural_map(func.body, (tirx.Var, lambda v: mapping.get(v, v)))


@module_pass(opt_level=0, name="GemvForFewRows")
class GemvForFewRows:
    """Give a weight matmul of cuBLASLt (``OffloadMatmul``) grape's GEMV kernels where its
    rows are few: one PrimFunc that launches the GEMV kernel of M's bucket (``GEMV_ROWS``,
    epilogue fused) and calls the library function above the last bucket, both on the
    stream being captured. cuBLASLt's kernels at M = 1 to 8 read the weight at a fraction of
    the bandwidth grape's reach (``GEMV_ROWS`` says how much), and decode is all such rows.

    CUDA only, after FuseTIR and before the GPU schedule rules (the PrimFuncs it makes are
    scheduled; those it reads are still as legalized). A matmul whose rows are static and
    above the buckets, an expression of dims, or more than one symbolic dim (``DecodeGemv``
    takes one) stays the library's alone; M = 0 is the library's (which launches nothing).

    An element-wise kernel of one input that alone reads the call's result (an erf GELU,
    which cuBLASLt's epilogues lack; ``unary_elementwise``) joins it: the GEMV kernels apply
    it in their epilogue, and above the buckets it runs as a kernel after the library's,
    in the same PrimFunc. The decode-loop benchmark's decoder had a GELU kernel a layer.

    A row norm whose output only the call reads as x (a layer norm; ``row_norm``; through
    a reshape that keeps the rows' width, as Hugging Face's Conv1D), with no in-place write
    between the two, joins it too (``_after_norm``): the one-row GEMV kernel computes the
    row's statistics and normalizes x as it reads it (``schedule_gemv``'s prologue); for
    more rows the norm's kernel writes its output to a second output of the call, which
    the GEMV kernel or the library reads. GPT-2's decode step had 25 layer-norm kernels.

    Before::

        y = R.call_dps_packed("grape.cublaslt.matmul_bias_nt", (x, w, b),
                              out_ty=R.Tensor((m, 3072), "float32"))   # w: (3072, 768)

    After::

        y = R.call_tir(matmul_bias_nt_gemv, (x, w, b), out_ty=R.Tensor((m, 3072), "float32"))

        @T.prim_func  # attrs: tirx.is_scheduled, grape.library_function, grape.gemv_rows
        def matmul_bias_nt_gemv(x: (m, 768), w: (3072, 768), bias: (3072,), out: (m, 3072)):
            if m <= 0:   T.call_packed("grape.cublaslt.matmul_bias_nt", x, w, bias, out)
            elif m <= 1: <GEMV kernel, 1 row per block, bias added>
            elif m <= 2: ...
            elif m <= 8: <GEMV kernel, 8 rows per block>
            else:        T.call_packed("grape.cublaslt.matmul_bias_nt", x, w, bias, out)

    and ``z = R.call_tir(gelu, (y,), ...)`` after it (``y`` read there alone) becomes
    ``z = R.call_tir(matmul_bias_nt_gelu_gemv, (x, w, b), ...)``: the GELU in each GEMV
    kernel's epilogue, and after the library call a kernel applying it to ``out`` in place.
    With ``x = R.call_tir(layer_norm, (h, g, beta), ...)`` before it (``x`` read there
    alone)::

        both = R.call_tir(matmul_bias_nt_layer_norm_gemv, (h, g, beta, w, b),
                          out_ty=[R.Tensor((m, 768)), R.Tensor((m, 3072))])
        y = both[1]
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        target = tvm.target.Target.current(allow_none=False)
        if target.kind.name != "cuda":
            return mod
        rewrite = _OnGemv(mod, target)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewrite.find_activations(func)
                rewrite.builder_.update_func(gvar, rewrite.visit_expr(func))
        if not any(rewrite.made.values()):
            return mod
        return _without_unread(rewrite.builder_.get(), set(rewrite.fused_kernels))


def _without_unread(mod: IRModule, kernels: set) -> IRModule:
    """``mod`` without those of ``kernels`` that no function calls any more (an activation
    fused everywhere it ran)."""
    called: set = set()
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(
                func, lambda e: isinstance(e, relax.GlobalVar) and called.add(e.name_hint))
    gone = [g for g in mod.get_global_vars() if g in kernels and g.name_hint not in called]
    for gvar in gone:
        del mod[gvar]
    return mod


@relax.expr_functor.mutator
class _OnGemv(relax.PyExprMutator):
    def __init__(self, mod: IRModule, target: tvm.target.Target):
        super().__init__(mod)
        self.mod = mod
        self.target = target
        # (function, rows, K, N, dtype, activation's kernel, norm's) -> its GlobalVar, or None
        self.made: dict = {}
        # a library call's variable -> (its one reader's variable, the element-wise kernel
        # that reader calls, that kernel's scalar function)
        self.activated: dict = {}
        self.fused: dict = {}  # such a reader's variable -> the fused call's, bound already
        self.fused_kernels: list = []  # the activations and norms fused into a matmul's
        # a library call's variable -> the binding of the row norm it alone reads (x)
        self.normalized: dict = {}
        self.held_vars: set = set()  # the norms' variables
        self.held: dict = {}  # a norm's variable -> its binding, not emitted (yet)
        self.is_norm: dict = {}  # a kernel's GlobalVar -> ``row_norm`` of it

    def find_activations(self, func: relax.Function) -> None:
        """The library calls whose one reader applies an element-wise kernel of one input
        to them (``unary_elementwise``: an erf GELU, which cuBLASLt's epilogues lack), and
        those whose x is a row norm's output that they alone read (``row_norm``: a layer
        norm), with no in-place write between the two."""
        reads = read_counts(func)
        self.activated, self.fused, self.normalized, self.held = {}, {}, {}, {}
        bound = relax.analysis.get_var2val(func)
        for var, value in bound.items():
            if not (isinstance(value, relax.Call) and value.op == _CALL_TIR and
                    len(value.args) == 2 and len(value.args[1].fields) == 1):
                continue
            source = value.args[1].fields[0]
            kernel = self.mod[value.args[0]]
            if not (isinstance(source, relax.DataflowVar) and reads.get(source) == 1 and
                    _library_call(bound.get(source)) is not None and
                    isinstance(kernel, tirx.PrimFunc)):
                continue
            scalar = unary_elementwise(kernel)
            if scalar is not None:
                self.activated[source] = (var, value.args[0], scalar)
        for block in func.body.blocks if isinstance(func.body, relax.SeqExpr) else ():
            self._find_norms(block.bindings, reads)
        self.held_vars = {b.var for chain in self.normalized.values() for b in chain}

    def _find_norms(self, bindings, reads) -> None:
        # a norm's variable, or that of a reshape of it keeping its rows' width (Hugging
        # Face's Conv1D flattens the batch dims), read once -> the indices of their bindings
        where: dict = {}
        for i, binding in enumerate(bindings):
            value = binding.value
            if _library_call(value) is not None and isinstance(value.args[1], relax.Tuple):
                x = value.args[1].fields[0]
                if x in where and reads.get(x) == 1 and not any(
                        _writes_in_place(b.value) for b in bindings[where[x][0] + 1:i]):
                    self.normalized[binding.var] = [bindings[j] for j in where[x]]
            if not (isinstance(binding.var, relax.DataflowVar) and isinstance(value, relax.Call)
                    and value.op == _CALL_TIR and len(value.args) == 2  # no scalar dims
                    and isinstance(value.args[0], relax.GlobalVar)):
                continue
            kernel = self.mod[value.args[0]]
            if not isinstance(kernel, tirx.PrimFunc):
                continue
            source = value.args[1].fields[0] if len(value.args[1].fields) == 1 else None
            gvar = value.args[0]
            if gvar not in self.is_norm:
                self.is_norm[gvar] = row_norm(kernel)
            if self.is_norm[gvar]:
                where[binding.var] = [i]
            elif source in where and reads.get(source) == 1 and _row_reshape(kernel):
                where[binding.var] = [*where[source], i]

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        function = _library_call(call)
        if function is None:
            return call
        gvar = self._gemv(function, call)
        return call if gvar is None else relax.call_tir(gvar, call.args[1], call.ty)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if binding.var in self.fused:  # the activation's reader: bound with the matmul
            self.set_var_remap(binding.var, self.fused.pop(binding.var))
            return
        if binding.var in self.held_vars:
            self.held[binding.var] = binding  # emitted with its matmul, or fused into it
            return
        if binding.var in self.activated or binding.var in self.normalized:
            # The matmul with its norm and its reader's activation fused, where the matmul
            # was: it reads its operands where the model did (no in-place write since the
            # norm's binding, ``_find_norms``).
            reader, kernel, scalar = self.activated.get(binding.var, (binding.var, None, None))
            norm = self.normalized.get(binding.var)
            library = self.builder_.normalize(relax.op.call_dps_packed(
                value.args[0], self.visit_expr(value.args[1]), value.ty))
            function = _library_call(value)
            gvar = None
            if norm is not None:
                gvar = self._gemv(function, library, kernel, scalar, [b.value for b in norm])
                if gvar is None:  # not fused: the norm (and reshape) where its matmul is
                    for held in norm:
                        super().visit_var_binding_(self.held.pop(held.var))
                    norm = None
            if gvar is None and kernel is not None:
                gvar = self._gemv(function, library, kernel, scalar)
            if gvar is not None:
                self._emit_fused(binding.var, gvar, library, norm, reader, kernel)
                return
        super().visit_var_binding_(binding)

    def _emit_fused(self, var, gvar, library, norm, reader, kernel) -> None:
        """Bind the fused GEMV call ``gvar`` in place of the matmul ``var`` (of the
        activation's ``reader`` where ``kernel`` is fused too; ``norm``: the bindings of the
        norm and a reshape of it, fused too)."""
        args = list(library.args[1].fields)
        if norm is not None:
            norm_args = [self.visit_expr(a) for a in norm[0].value.args[1].fields]
            both = self.builder_.emit(relax.call_tir(gvar, [*norm_args, *args[1:]],
                                                     [norm[-1].var.ty, reader.ty]))
            result = relax.TupleGetItem(both, 1)
            for held in norm:
                self.held.pop(held.var)
                self.fused_kernels.append(held.value.args[0])
        else:
            result = relax.call_tir(gvar, args, reader.ty)
        if kernel is not None:
            self.fused[reader] = emit_as(self.builder_, reader, result)
            self.fused_kernels.append(kernel)
        else:
            self.set_var_remap(var, emit_as(self.builder_, var, result))

    def _gemv(self, function: MatmulFunction, call: relax.Call, activation=None, scalar=None,
              norm: list | None = None):
        """The GlobalVar of the GEMV PrimFunc of ``call`` (``activation``: the kernel whose
        ``scalar`` function it applies after; ``norm``: the calls of the row norm, and of a
        reshape of its output, that give its x), made once; None where there is none."""
        out_ty = call.ty
        rows = _fresh_dims(out_ty.shape.values[:-1])
        if rows is None:
            return None
        if not isinstance(call.args[1], relax.Tuple):
            return None
        x_ty = call.args[1].fields[0].ty
        k, n, dtype = int(x_ty.shape.values[-1]), int(out_ty.shape.values[-1]), str(out_ty.dtype)
        key = (function.name, tuple(str(r) for r in rows), k, n, dtype,
               None if activation is None else activation.name_hint,
               None if norm is None else tuple(c.args[0].name_hint for c in norm))
        if key not in self.made:
            norm_func = None
            if norm is not None:  # the norm, then each reshape; the matmul takes its dims
                norm_func = self.mod[norm[0].args[0]]
                for reshape in norm[1:]:
                    norm_func = compose_after(norm_func, self.mod[reshape.args[0]])
                rows = list(norm_func.params[-1].shape[:-1])
            func = few_rows_gemv(function, matmul_prim_func(function, rows, k, n, dtype, scalar),
                                 self.target, scalar, norm_func)
            name = function.name.rsplit(".", 1)[-1] + \
                ("" if norm is None else "_" + norm[0].args[0].name_hint) + \
                ("" if activation is None else "_" + activation.name_hint) + "_gemv"
            self.made[key] = None if func is None else self.builder_.add_func(func, name)
        return self.made[key]


def _row_reshape(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` only reshapes its one input, keeping the last dim (rows merged or
    split, each row as it was)."""
    if len(func.params) != 2 or not relax.analysis.has_reshape_pattern(func):
        return False
    source, out = func.params
    return (isinstance(source.shape[-1], tirx.IntImm) and isinstance(out.shape[-1], tirx.IntImm)
            and int(source.shape[-1]) == int(out.shape[-1]))


def _writes_in_place(value: relax.Expr) -> bool:
    """Whether a binding's value writes a tensor it reads (``call_tir_inplace``)."""
    return isinstance(value, relax.Call) and value.op == _CALL_TIR_INPLACE
