"""Legalizations that give NaN, infinities, empty reductions and half precision the
results of onnxruntime and PyTorch.

TVM's legalizations compute ``relu`` as ``max(x, 0)``, ``clip`` as ``max(min(x, hi), lo)``
and ``maximum``/``minimum`` with TIR's ``max``/``min``, which drop a NaN (``relu(NaN)`` is
0; onnxruntime keeps NaN). A float max or min reduction starts from the lowest (highest)
finite float, so over nothing, or over a slice that is all -inf (a fully masked attention
row), it returns -3.4e38 where onnxruntime returns -inf; here it starts from -inf (+inf).
A mean over nothing divides by 0 (onnxruntime returns 0; ONNX leaves it undefined). A
float16 matmul or softmax sums in float16; here in float32, rounded once at the end, as
PyTorch and onnx's reference do. ``numerics_legalize_map`` maps those ops to kernels that
keep TVM's values everywhere else, for ``LegalizeOps``'s ``customize_legalize_map``; the
names of the kernels are TVM's.

Before (``relu`` of a float32 tensor, TVM's legalization)::

    compute[i] = T.max(x[i], T.float32(0.0))                        # NaN -> 0

After::

    compute[i] = T.Let(T.Select(v < T.float32(0.0), T.float32(0.0), v),
                       where={v: x[i]})                              # NaN -> NaN

What stays TVM's: integer tensors (no NaN), a max/min reduction over values that are NaN
(TVM and onnxruntime each keep or drop it depending on where it is), on a GPU a max/min
over a slice of only -inf (+inf) (the schedules' cross-thread reductions know only TVM's
identities: the lowest finite float is returned), and ops not listed here.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax, te, tirx, topi
from tvm.sym.analyzer import Analyzer


def _is_float(dtype) -> bool:
    return str(dtype).startswith(("float", "bfloat"))


def _default(op_name: str) -> Callable:
    """TVM's own legalization of ``op_name``."""
    return tvm.ir.Op.get(op_name).get_attr("FLegalize")


def _once(value: tirx.PrimExpr, body: Callable) -> tirx.PrimExpr:
    """``body(v)`` with ``v`` bound to ``value`` once (a Let): the selects below read their
    operand several times, and inlined into a consumer (a matmul's epilogue) an operand is
    a whole expression that would be copied at each read."""
    var = tirx.Var("v", str(value.ty))
    return tirx.Let(var, value, body(var))


def _relu(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    x = call.args[0]
    if not _is_float(x.ty.dtype):
        return _default("relax.nn.relu")(bb, call)

    def relu(data: te.Tensor) -> te.Tensor:
        zero = tirx.const(0, data.dtype)
        return te.compute(data.shape, lambda *i: _once(
            data(*i), lambda v: tirx.Select(v < zero, zero, v)), name="compute", tag="elemwise")

    return bb.call_te(relu, x, primfunc_name_hint="relu")


def _clip(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    x, lo, hi = call.args
    if not _is_float(x.ty.dtype):
        return _default("relax.clip")(bb, call)

    def clip(data: te.Tensor, low, high) -> te.Tensor:
        low, high = tirx.const(low, data.dtype), tirx.const(high, data.dtype)
        return te.compute(data.shape, lambda *i: _once(data(*i), lambda v: tirx.Select(
            v < low, low, tirx.Select(v > high, high, v))), name="compute", tag="elemwise")

    # min and max are constants (PrimValue), as R.clip takes them.
    return bb.call_te(clip, x, float(lo.value), float(hi.value), primfunc_name_hint="tir_clip")


def _is_one(dim) -> bool:
    return isinstance(dim, tirx.IntImm) and dim.value == 1


def _broadcast_shape(a: te.Tensor, b: te.Tensor) -> list:
    """numpy's broadcast of two shapes (a dim of 1 takes the other; others are equal)."""
    ndim = max(len(a.shape), len(b.shape))
    dims_a = [tirx.const(1, "int64")] * (ndim - len(a.shape)) + list(a.shape)
    dims_b = [tirx.const(1, "int64")] * (ndim - len(b.shape)) + list(b.shape)
    return [db if _is_one(da) else da for da, db in zip(dims_a, dims_b)]


def _broadcast(tensor: te.Tensor, ndim: int):
    """Index ``tensor`` with an output index of rank ``ndim`` (numpy broadcasting)."""
    pad = ndim - len(tensor.shape)

    def load(*index):
        return tensor(*[tirx.const(0, str(d.ty)) if _is_one(d) else index[pad + k]
                        for k, d in enumerate(tensor.shape)])

    return load


def _nan_or(pick: Callable, op_name: str, kernel: str) -> Callable:
    """``maximum``/``minimum``: NaN where either operand is NaN, else ``pick``."""

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        if not _is_float(call.ty.dtype):
            return _default(op_name)(bb, call)

        def compute(a: te.Tensor, b: te.Tensor) -> te.Tensor:
            shape = _broadcast_shape(a, b)
            load_a, load_b = _broadcast(a, len(shape)), _broadcast(b, len(shape))

            def value(*i):
                return _once(load_a(*i), lambda va: _once(load_b(*i), lambda vb: tirx.Select(
                    tirx.isnan(va), va, tirx.Select(tirx.isnan(vb), vb, pick(va, vb)))))

            return te.compute(shape, value, name=f"T_{kernel}", tag="broadcast")

        return bb.call_te(compute, call.args[0], call.args[1], primfunc_name_hint=kernel)

    return legalize


def _sign(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    x = call.args[0]
    if not _is_float(x.ty.dtype):
        return _default("relax.sign")(bb, call)

    def sign(data: te.Tensor) -> te.Tensor:
        one, zero = tirx.const(1, data.dtype), tirx.const(0, data.dtype)
        return te.compute(data.shape, lambda *i: _once(data(*i), lambda v: tirx.Select(
            v > zero, one, tirx.Select(v < zero, -one, tirx.Select(tirx.isnan(v), v, zero)))),
            name="compute", tag="elemwise")

    return bb.call_te(sign, x, primfunc_name_hint="tir_sign")


def _reduced_count(shape, axis) -> tirx.PrimExpr:
    """How many values each output element of a reduction over ``axis`` of ``shape``
    reduces (a PrimExpr of the shape's dims)."""
    axes = range(len(shape)) if axis is None else [int(a) % len(shape) for a in axis]
    count = tirx.const(1, "int64")
    for a in axes:
        count = count * shape[a]
    return Analyzer().simplify(count)


def _may_be_empty(call: relax.Call) -> bool:
    """A reduction of a known shape whose reduced dims may multiply to 0."""
    ty = call.args[0].ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return False
    count = _reduced_count(list(ty.shape.values), call.attrs.axis)
    return not isinstance(count, tirx.IntImm) or count.value == 0


def _extreme_reduction(op_name: str, infinite_identity: bool) -> Callable:
    """A float max (min) reduction that is -inf (+inf) over nothing and, with
    ``infinite_identity``, over a slice that is all -inf (a fully masked attention row),
    where TVM's identity, the lowest finite float, gave -3.4e38 (and a mask test
    ``max == -inf`` failed). GPU schedules need TVM's identity (their cross-thread
    reductions match only TVM's own reducers): there, only the empty case is fixed."""
    sign = -1.0 if op_name == "relax.max" else 1.0
    pick = tirx.max if op_name == "relax.max" else tirx.min
    short = op_name.split(".")[-1]
    reducer = te.comm_reducer(lambda a, b: pick(a, b),
                              lambda dtype: tirx.const(sign * float("inf"), dtype), name=short)

    def reduce(data: te.Tensor, axis, keepdims: bool) -> te.Tensor:
        if not infinite_identity:
            return (topi.max if op_name == "relax.max" else topi.min)(data, axis, keepdims)
        ndim = len(data.shape)
        axes = sorted(range(ndim) if axis is None else {int(a) % ndim for a in axis})
        shape = [1 if a in axes else data.shape[a] for a in range(ndim)] if keepdims \
            else [data.shape[a] for a in range(ndim) if a not in axes]

        def value(*index):
            over = iter([te.reduce_axis((0, data.shape[a]), name=f"k{a}") for a in axes])
            kept = iter(index)
            source = []
            for a in range(ndim):
                source.append(next(over) if a in axes else next(kept))
                if a in axes and keepdims:
                    next(kept)
            return reducer(data(*source), axis=[v for v in source if isinstance(v, tirx.IterVar)])

        return te.compute(shape, value, name=f"{short}_red")

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        if not _is_float(call.ty.dtype) or (not infinite_identity and not _may_be_empty(call)):
            return _default(op_name)(bb, call)
        may_be_empty = _may_be_empty(call)

        def compute(data: te.Tensor, axis, keepdims: bool) -> te.Tensor:
            reduced = reduce(data, axis, keepdims)
            if not may_be_empty:
                return reduced
            # A loop of no iterations never runs its init unless hoisted (HoistReductionInit).
            count = _reduced_count(data.shape, axis)
            empty = tirx.const(sign * float("inf"), data.dtype)
            return te.compute(reduced.shape, lambda *i: tirx.Select(
                count == 0, empty, reduced(*i)), name=f"{reduced.op.name}_or_empty")

        return bb.call_te(compute, call.args[0], call.attrs.axis, call.attrs.keepdims,
                          primfunc_name_hint=short)

    return legalize


_HALF = ("float16", "bfloat16")


def _matmul(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """A half-precision matmul summed in float32 and rounded once, as PyTorch and onnx's
    reference compute it (TVM sums in the output's type: 1e-3 off on a 64-term dot)."""
    a, b = call.args
    if str(call.ty.dtype) not in _HALF or str(a.ty.dtype) not in _HALF or \
            str(b.ty.dtype) not in _HALF:
        return _default("relax.matmul")(bb, call)
    wide = bb.normalize(relax.op.matmul(a, b, out_dtype="float32"))
    summed = bb.emit(_default("relax.matmul")(bb, wide))
    return bb.call_te(topi.cast, summed, str(call.ty.dtype), primfunc_name_hint="cast")


def _softmax(op_name: str) -> Callable:
    """A half-precision softmax (log-softmax) computed in float32, rounded once at the end."""
    kernel = topi.nn.softmax if op_name == "relax.nn.softmax" else topi.nn.log_softmax

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        dtype = str(call.ty.dtype)
        if dtype not in _HALF:
            return _default(op_name)(bb, call)

        def compute(data: te.Tensor, axis: int) -> te.Tensor:
            wide = topi.cast(data, "float32")
            return topi.cast(kernel(wide, axis=axis), dtype)

        return bb.call_te(compute, call.args[0], int(call.attrs.axis),
                          primfunc_name_hint=op_name.split(".")[-1])

    return legalize


def _mean(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    if not _may_be_empty(call):
        return _default("relax.mean")(bb, call)

    def mean(data: te.Tensor, axis, keepdims: bool) -> te.Tensor:
        total = topi.sum(data, axis, keepdims)
        count = _reduced_count(data.shape, axis)
        # Over nothing: 0 / 1, as onnxruntime (TVM divides by 0).
        return topi.divide(total, tirx.Cast(data.dtype, tirx.max(count, 1)))

    return bb.call_te(mean, call.args[0], call.attrs.axis, call.attrs.keepdims,
                      primfunc_name_hint="mean")


def numerics_legalize_map(gpu: bool = False) -> dict[str, Callable]:
    """``LegalizeOps``' ``customize_legalize_map`` for onnxruntime's NaN and empty-reduction
    results (module docstring); ``gpu``: a max/min of all -inf stays TVM's (``_extreme_reduction``)."""
    return {
        "relax.nn.relu": _relu,
        "relax.clip": _clip,
        "relax.maximum": _nan_or(tirx.max, "relax.maximum", "maximum"),
        "relax.minimum": _nan_or(tirx.min, "relax.minimum", "minimum"),
        "relax.sign": _sign,
        "relax.max": _extreme_reduction("relax.max", infinite_identity=not gpu),
        "relax.min": _extreme_reduction("relax.min", infinite_identity=not gpu),
        "relax.matmul": _matmul,
        "relax.nn.softmax": _softmax("relax.nn.softmax"),
        "relax.nn.log_softmax": _softmax("relax.nn.log_softmax"),
        "relax.mean": _mean,
    }
