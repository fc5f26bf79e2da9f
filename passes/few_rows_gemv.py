"""A library matmul with few rows runs on grape's GEMV kernels, and on the library above."""

from __future__ import annotations

import math

import tvm
from tvm import IRModule, relax, te, tirx
from tvm.ir import Op
from tvm.ir.transform import PassContext, module_pass

from grape_tvm.runtime.cublaslt import MATMUL_FUNCTIONS, MatmulFunction

from .gemv_schedule import gemv_by_rows, match_gemv

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
                     dtype: str) -> tirx.PrimFunc:
    """What ``function`` computes, as a PrimFunc: ``out[rows.., n] = epilogue(sum_k x[rows..,
    k] w[k, n] (+ residual) (+ bias))``, summed and finished in fp32 and rounded once, as
    cuBLASLt does (w[n, k] where the weight is transposed). Parameters in the packed
    function's order: x, w, bias, residual, out."""
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
        return v.astype(dtype)

    out = te.compute((*rows, n), finish, name="epilogue")
    params = [t for t in (x, w, bias, residual, out) if t is not None]
    return te.create_prim_func(params)


def few_rows_gemv(function: MatmulFunction, func: tirx.PrimFunc,
                  target: tvm.target.Target) -> tirx.PrimFunc | None:
    """``func`` (``matmul_prim_func``) as GEMV kernels for the rows of ``GEMV_ROWS`` and a
    call of the library function above them (and at M = 0: it launches nothing, where a
    kernel of 0 blocks would fail), chosen on the host; None where the GEMV rule does not
    take it. Static rows within the buckets: one GEMV kernel, no library."""
    shape = match_gemv(func)
    if shape is None:
        return None
    buckets = GEMV_ROWS[shape.layout]
    # the parameters are buffers: passed to the packed function as DLTensors
    library = func.with_body(tirx.Evaluate(tirx.call_packed(function.name, *func.params)))
    scheduled = gemv_by_rows(func, shape, buckets, target, default=library,
                             before=((0, library),))
    if scheduled is None:
        return None
    attrs = {"tirx.is_scheduled": True}
    if shape.symbolic:
        attrs.update({LIBRARY_FUNCTION_ATTR: function.name, GEMV_ROWS_ATTR: list(buckets)})
    # its name comes from the module it joins (AttachGlobalSymbol), not te's "main"
    return scheduled.without_attr("global_symbol").with_attrs(attrs)


@module_pass(opt_level=0, name="GemvForFewRows")
class GemvForFewRows:
    """Give a weight matmul of cuBLASLt (``OffloadMatmul``) grape's GEMV kernels where its
    rows are few: one PrimFunc that launches the GEMV kernel of M's bucket (``GEMV_ROWS``,
    epilogue fused) and calls the library function above the last bucket, both on the
    stream being captured. cuBLASLt's kernels at M = 1 to 8 read the weight at a fraction of
    the bandwidth grape's reach (``GEMV_ROWS`` says how much), and decode is all such rows.

    CUDA only, after the GPU schedule rules (the PrimFunc is scheduled). A matmul whose rows
    are static and above the buckets, an expression of dims, or more than one symbolic dim
    (``DecodeGemv`` takes one) stays the library's alone; M = 0 is the library's (which
    launches nothing).

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
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        target = tvm.target.Target.current(allow_none=False)
        if target.kind.name != "cuda":
            return mod
        rewrite = _OnGemv(mod, target)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewrite.builder_.update_func(gvar, rewrite.visit_expr(func))
        return rewrite.builder_.get() if any(rewrite.made.values()) else mod


@relax.expr_functor.mutator
class _OnGemv(relax.PyExprMutator):
    def __init__(self, mod: IRModule, target: tvm.target.Target):
        super().__init__(mod)
        self.target = target
        self.made: dict = {}  # (function, rows, K, N, dtype) -> its GlobalVar, or None

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        function = _library_call(call)
        if function is None:
            return call
        gvar = self._gemv(function, call)
        return call if gvar is None else relax.call_tir(gvar, call.args[1], call.ty)

    def _gemv(self, function: MatmulFunction, call: relax.Call):
        out_ty = call.ty
        rows = _fresh_dims(out_ty.shape.values[:-1])
        if rows is None:
            return None
        if not isinstance(call.args[1], relax.Tuple):
            return None
        x_ty = call.args[1].fields[0].ty
        k, n, dtype = int(x_ty.shape.values[-1]), int(out_ty.shape.values[-1]), str(out_ty.dtype)
        key = (function.name, tuple(str(r) for r in rows), k, n, dtype)
        if key not in self.made:
            func = few_rows_gemv(function, matmul_prim_func(function, rows, k, n, dtype),
                                 self.target)
            name = function.name.rsplit(".", 1)[-1] + "_gemv"
            self.made[key] = None if func is None else self.builder_.add_func(func, name)
        return self.made[key]
