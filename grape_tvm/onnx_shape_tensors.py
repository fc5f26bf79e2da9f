"""ONNX inputs that decide a shape, given as tensors computed at run time.

TVM 0.27's converters take the inputs that decide an output's shape (``Reshape``'s shape,
``ConstantOfShape``'s shape, the ``Reduce*`` ops' axes) only as constants, or as shape
expressions made from other shapes (``Shape`` -> ``Concat`` -> ``Reshape``). A tensor
computed at run time (a graph input, or arithmetic on shapes) fails the import. onnx's
node tests give these inputs as graph inputs, and exporters compute them (an attention
function's ``Concat`` of a shape's slice with a constant).

The converters here read such a tensor at run time instead:

* the output's shape is the tensor itself, turned into a shape of fresh dims
  (``R.tensor_to_shape`` and ``R.match_cast``, TVM's own ``_tensor_to_shape_expr``): the
  call's output has a data-dependent shape, which grape runs like ``NonZero``'s;
* the kernel that depends on the values (which axes a reduction sums) reads the tensor
  itself (``reduce_over_runtime_axes``);
* a ``Concat`` of shape expressions and tensors concatenates them all as tensors.

A converter handles only the run-time case and hands every other one to TVM's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.relax.frontend.onnx import onnx_frontend as tvm_onnx

REDUCE_OPS = ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax",
              "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare")


def _is_known(value, params) -> bool:
    """Known at import time: a shape expression, a constant or an initializer."""
    return isinstance(value, relax.ShapeExpr) or \
        isinstance(tvm_onnx.get_constant(value, params), tvm.ir.GenericConst)


def vector_length(value) -> int | None:
    """The static length of a 1-d tensor, else None."""
    ty = getattr(value, "ty", None)
    if not isinstance(ty, relax.TensorType) or ty.ndim != 1 or \
            not isinstance(ty.shape, relax.ShapeExpr):
        return None
    (length,) = ty.shape.values
    return int(length.value) if isinstance(length, tirx.IntImm) else None


def _is_empty_shape(value, params) -> bool:
    """A shape known at import time to have no dims (a scalar's)."""
    if isinstance(value, relax.ShapeExpr):
        return len(value.values) == 0
    if vector_length(value) == 0:
        return True
    const = tvm_onnx.get_constant(value, params)
    return isinstance(const, tvm.ir.GenericConst) and const.value.numpy().size == 0


def _static_rank(value) -> int | None:
    ty = getattr(value, "ty", None)
    return ty.ndim if isinstance(ty, relax.TensorType) and ty.ndim >= 0 else None


def int64_tensor(bb, value) -> relax.Expr:
    if isinstance(value, relax.ShapeExpr):
        return bb.normalize(relax.op.shape_to_tensor(value))
    return value if value.ty.dtype == "int64" else bb.normalize(relax.op.astype(value, "int64"))


def _i64(value: int) -> relax.Expr:
    return relax.const(value, "int64")


def as_int64(dim: tirx.PrimExpr) -> tirx.PrimExpr:
    """``dim`` as an int64 expression (a cast only where it is another integer type)."""
    return dim if str(dim.ty) == "int64" else tirx.Cast("int64", dim)


def _shape_tensor(bb, data) -> relax.Expr:
    """``data``'s shape as an int64 tensor (its dims may be symbolic)."""
    return bb.normalize(relax.op.shape_to_tensor(relax.ShapeExpr(
        [as_int64(d) for d in data.ty.shape.values])))


def shape_from(bb, values: relax.Expr, length: int, prefix: str) -> relax.ShapeExpr:
    """A run-time int64 tensor of ``length`` elements as a shape of fresh dims."""
    return tvm_onnx._tensor_to_shape_expr(bb, values, length, prefix)  # pylint: disable=protected-access


class Reshape(tvm_onnx.Reshape):
    """``Reshape`` to a shape computed at run time.

    The target shape's ``0`` (copy the input's dim, unless ``allowzero``) and ``-1`` (what
    the element count leaves) are resolved on the tensor, then read as a shape.

    And of a dim that TVM keeps as a scalar (``Reshape(Shape(k)[2] + 1, [-1])``, the dynamo
    exporter's), which TVM's reshape refuses (it takes tensors): ``_reshape_dim``.
    """

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, shape = inputs
        if _is_integer_dim(data):
            return _reshape_dim(bb, data, shape, attr, params)
        length = vector_length(shape)
        if _is_known(shape, params) or isinstance(data, relax.ShapeExpr) or length is None or \
                not isinstance(getattr(data, "ty", None), relax.TensorType) or \
                not isinstance(data.ty.shape, relax.ShapeExpr):
            return super()._impl_v13(bb, inputs, attr, params)
        target = int64_tensor(bb, shape)
        in_shape = _shape_tensor(bb, data)
        rank = data.ty.ndim
        if not attr.get("allowzero", 0):
            # A 0 past the input's rank has no dim to copy: left as 0, the reshape fails.
            copied = in_shape if rank == length else bb.normalize(
                relax.op.strided_slice(in_shape, [0], [0], [length]) if rank > length else
                relax.op.concat([in_shape, relax.const([0] * (length - rank), "int64")]))
            target = bb.normalize(relax.op.where(relax.op.equal(target, _i64(0)), copied, target))
        inferred = relax.op.equal(target, _i64(-1))
        known = bb.normalize(relax.op.prod(relax.op.where(inferred, _i64(1), target)))
        count = bb.normalize(relax.op.prod(in_shape))
        rest = relax.op.floor_divide(count, relax.op.maximum(known, _i64(1)))
        checked = target
        target = bb.normalize(relax.op.where(inferred, rest, target))
        # onnxruntime refuses such a shape; unchecked, the reshape would read past the data.
        fits = relax.op.logical_and(
            relax.op.logical_and(
                relax.op.less_equal(relax.op.sum(relax.op.astype(inferred, "int64")), _i64(1)),
                relax.op.greater_equal(relax.op.min(checked), _i64(-1))),
            relax.op.equal(relax.op.prod(target), count))
        bb.emit(relax.op.assert_op(fits, [], "Reshape: the shape given at run time must keep "
                                   "the element count, with at most one -1 and no other "
                                   "negative dim"))
        return relax.op.reshape(data, shape_from(bb, target, length, "reshape_dim"))


class ConstantOfShape(tvm_onnx.ConstantOfShape):
    """``ConstantOfShape`` of a shape computed at run time: TVM broadcasts to a shape of
    unknown values, which its legalization rejects; the shape gets fresh dims first.

    And of the empty shape (a scalar; transformers' attention mask makes one from
    ``Shape`` of a scalar): TVM broadcasts the one-element ``value`` tensor to rank 0,
    which ``broadcast_to`` refuses; it is the scalar ``value``.
    """

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        (shape,) = inputs
        length = vector_length(shape)
        if _is_empty_shape(shape, params):
            value = attr.get("value")
            scalar = tvm_onnx.get_numpy(value).reshape(()) if value is not None else \
                np.zeros((), "float32")
            return relax.const(scalar, str(scalar.dtype))
        if _is_known(shape, params) or length is None:
            return super()._impl_v9(bb, inputs, attr, params)
        values = int64_tensor(bb, shape)
        bb.emit(relax.op.assert_op(
            relax.op.greater_equal(relax.op.min(values), _i64(0)), [],
            "ConstantOfShape: the shape given at run time must have no negative dim"))
        dims = shape_from(bb, values, length, "constant_dim")
        return super()._impl_v9(bb, [dims], attr, params)


def _reshape_dim(bb, dim: tirx.PrimExpr, shape, attr, params) -> relax.Expr:
    """``Reshape`` of a dim TVM keeps as a scalar: to one element, the shape expression
    ``(dim,)`` (what TVM makes of a 1-d shape value, so that it stays symbolic through
    ``Concat`` into an ``Expand`` or ``Reshape``); to a scalar, the dim itself; else its
    tensor (of the dim's dtype), reshaped."""
    dtype = str(dim.ty)
    target = tvm_onnx.get_constant(shape, params)
    if isinstance(target, tvm.ir.GenericConst):
        values = [int(v) for v in target.value.numpy().reshape(-1)]
        if values in ([-1], [1]) and dtype == "int64":
            return relax.ShapeExpr([dim])
        if not values:
            return dim
    return Reshape._impl_v13(bb, [_dim_tensor(bb, dim, [], dtype), shape], attr, params)


class Concat(tvm_onnx.Concat):
    """``Concat`` of shape expressions with run-time tensors: all as int64 tensors.

    TVM concatenates shape expressions into a shape expression, and tensors into a
    tensor; a mix (an exporter's ``Concat(Shape(k)[:2], [-1, d])`` where the constant is
    computed) fails the import. The shapes become tensors (``shape_to_tensor``).
    """

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        shapes = [isinstance(x, relax.ShapeExpr) for x in inputs]
        if not any(shapes) or all(shapes) or all(_is_known(x, params) for x in inputs):
            return super()._impl_v13(bb, inputs, attr, params)
        return relax.op.concat([int64_tensor(bb, x) for x in inputs], axis=attr.get("axis", 0))


class Gather(tvm_onnx.Gather):
    """``Gather`` of a shape expression by a constant vector of indices: the shape
    expression of the dims picked.

    onnxruntime's transpose optimizer reads a transposed tensor's dims this way
    (``Gather(Shape(k), [0, 2, 1, 3])``). TVM gathers from the shape turned into a run-time
    tensor: the dims' values are lost, and what is computed from them (Llama's rotary
    ``Slice`` to half the head size) gets an unknown shape.
    """

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, indices = inputs
        picked = tvm_onnx.get_constant(indices, params)
        if isinstance(data, relax.ShapeExpr) and isinstance(picked, tvm.ir.GenericConst) and \
                attr.get("axis", 0) in (0, -1) and picked.value.numpy().ndim == 1:
            dims, rank = data.values, len(data.values)
            positions = [int(i) for i in picked.value.numpy()]
            if all(-rank <= i < rank for i in positions):
                return relax.ShapeExpr([dims[i % rank] for i in positions])
        return super()._impl_v13(bb, inputs, attr, params)


class Size(tvm_onnx.Size):
    """``Size`` known at import time: of a shape expression (``Shape``'s output, so a rank)
    or of a tensor of constant shape, a constant.

    TVM computes it at run time, and what follows from it (an expanded RMS norm's
    ``Range(axis, Size(Shape(x)))`` reduce axes) is then a run-time tensor too; with it
    constant, that ``Range`` is an ``arange`` of constants, which the ``Reduce*`` converters
    read as constant axes (``_constant_range``).
    """

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        (data,) = inputs
        if isinstance(data, relax.ShapeExpr):
            return relax.const(len(data.values), "int64")
        shape = getattr(getattr(data, "ty", None), "shape", None)
        if isinstance(shape, relax.ShapeExpr) and \
                all(isinstance(d, tirx.IntImm) for d in shape.values):
            count = 1
            for dim in shape.values:
                count *= int(dim.value)
            return relax.const(count, "int64")
        return super()._impl_v1(bb, inputs, attr, params)


class KeepsRank:
    """A mixin for a ``BinaryBase`` converter (``Add``, ``Sub``, ``Mul``, ``Div``, ``Mod``):
    a dim combined with one-element constant tensors keeps their rank.

    TVM folds ``Add([0], dim)`` (the dynamo exporter's position ids: an ``arange`` of one
    element plus the past length) into the scalar ``dim``: the tensor's rank is lost, and
    what follows fails (``Unsqueeze`` axes out of range) or broadcasts to another shape.
    Whatever ``_impl_vN`` the op's opset picks, its result goes through
    ``_with_rank_of_constants``.
    """

    @classmethod
    def get_converter(cls, opset):
        convert = super().get_converter(opset)

        def keeping_rank(bb, inputs, attr, params):
            return _with_rank_of_constants(bb, inputs, convert(bb, inputs, attr, params))

        return keeping_rank


def _with_rank_of_constants(bb, inputs, out):
    """``out``, an integer dim TVM folded from ``inputs``, with their constants' rank: the
    shape expression ``(dim,)`` for int64 of rank 1 (as TVM keeps 1-d shape values, so it
    stays symbolic into a ``Concat``, ``Expand`` or ``Reshape``), else a tensor."""
    consts = [x.value.numpy() for x in inputs if isinstance(x, tvm.ir.GenericConst)]
    rank = max((c.ndim for c in consts), default=0)
    if rank == 0 or not _is_integer_dim(out) or any(c.size != 1 for c in consts):
        return out
    dtype = str(consts[0].dtype)
    if rank == 1 and dtype == "int64":
        return relax.ShapeExpr([as_int64(out)])
    return _dim_tensor(bb, out, [1] * rank, dtype)


def _is_integer_dim(value) -> bool:
    """A dim TVM keeps as a scalar (``PrimExpr``) of an integer type."""
    return tvm.ir.is_prim_expr(value) and str(value.ty).startswith(("int", "uint"))


def _dim_tensor(bb, dim: tirx.PrimExpr, shape: list[int], dtype: str) -> relax.Expr:
    """``dim`` as a ``dtype`` tensor of ``shape`` (one element)."""
    values = bb.normalize(relax.op.reshape(
        relax.op.shape_to_tensor(relax.ShapeExpr([as_int64(dim)])), shape))
    return values if dtype == "int64" else bb.normalize(relax.op.astype(values, dtype))


class Add(KeepsRank, tvm_onnx.Add):
    """``Add``, keeping a constant's rank: ``KeepsRank``."""


class Sub(KeepsRank, tvm_onnx.Sub):
    """``Sub``, keeping a constant's rank: ``KeepsRank``."""


class Mul(KeepsRank, tvm_onnx.Mul):
    """``Mul``, keeping a constant's rank: ``KeepsRank``."""


class Div(KeepsRank, tvm_onnx.Div):
    """``Div``, keeping a constant's rank: ``KeepsRank``."""


# -- reductions over axes given at run time ---------------------------------------------------

def _extreme(dtype: str, sign: int) -> tirx.PrimExpr:
    """The identity of a max (``sign`` -1) or min (+1) over ``dtype``: an infinity for
    floats, as onnx's reference gives an empty slice, else the type's extreme."""
    if "float" in str(dtype):
        return tirx.const(sign * float("inf"), dtype)
    return tvm.tirx.max_value(dtype) if sign > 0 else tvm.tirx.min_value(dtype)


def _combiner(op: str) -> tuple[Callable, Callable]:
    """For ``op``, how one element enters the reduction, and the reducer (``te.sum`` ...)."""
    square = lambda v: v * v  # noqa: E731
    return {
        "ReduceSum": (lambda v: v, te.sum),
        "ReduceMean": (lambda v: v, te.sum),
        "ReduceSumSquare": (square, te.sum),
        "ReduceL1": (tvm.tirx.abs, te.sum),
        "ReduceL2": (square, te.sum),
        "ReduceLogSum": (lambda v: v, te.sum),
        "ReduceMax": (lambda v: v, te.comm_reducer(
            lambda a, b: tirx.max(a, b), lambda t: _extreme(t, -1), name="max")),
        "ReduceMin": (lambda v: v, te.comm_reducer(
            lambda a, b: tirx.min(a, b), lambda t: _extreme(t, +1), name="min")),
        "ReduceProd": (lambda v: v, te.comm_reducer(
            lambda a, b: a * b, lambda t: tirx.const(1, t), name="prod")),
    }[op]


def _finish(op: str, total: tirx.PrimExpr, count: tirx.PrimExpr, dtype: str) -> tirx.PrimExpr:
    """The reduction's result from its accumulated ``total`` over ``count`` elements."""
    if op == "ReduceMean":  # over nothing: 0, as onnxruntime (and grape's constant-axes mean)
        return tirx.Select(count == 0, tirx.const(0, dtype), total / tirx.Cast(dtype, count)) \
            if "float" in dtype else \
            tirx.truncdiv(total, tirx.Cast(dtype, tirx.max(count, 1)))  # numpy: mean, then cast
    if op == "ReduceL2":
        return tvm.tirx.sqrt(total)
    if op == "ReduceLogSum":
        return tvm.tirx.log(total)
    return total


def _input_index(x: te.Tensor, reduced: te.Tensor, out_index, k: tirx.Var) -> list:
    """The element of ``x`` that the ``k``-th step of the reduction for ``out_index`` reads:
    ``k`` counts through the reduced axes (the last fastest), every other axis is the
    output's (keepdims form: a reduced axis has index 0 there)."""
    index, rest = [None] * len(x.shape), k
    for axis in reversed(range(len(x.shape))):
        extent = tirx.max(as_int64(x.shape[axis]), tirx.IntImm("int64", 1))
        is_reduced = reduced[axis] != 0
        index[axis] = tirx.Select(is_reduced, tirx.floormod(rest, extent),
                                  as_int64(out_index[axis]))
        rest = tirx.Select(is_reduced, tirx.floordiv(rest, extent), rest)
    return index


def reduce_over_runtime_axes(op: str, x: te.Tensor, reduced: te.Tensor,
                             out_shape: list[tirx.PrimExpr], count: tirx.PrimExpr) -> te.Tensor:
    """``op`` over the axes where ``reduced`` (int64, one per axis of ``x``) is non-zero, into
    ``out_shape`` (``x``'s shape with 1 on those axes); ``count`` elements per output.

    One kernel whatever the axes: each output element loops over ``count`` elements,
    decoding the reduced axes' indices from the loop counter.
    """
    def element(index, k: tirx.IterVar) -> tirx.PrimExpr:
        return x(*_input_index(x, reduced, index, k))

    def over(name: str, body) -> te.Tensor:
        """``body(index, k)`` reduced over a fresh axis of ``count`` steps."""
        k = te.reduce_axis((0, count), name="k")
        return te.compute(out_shape, lambda *i: body(i, k), name=name)

    if x.dtype == "bool" and op in ("ReduceMax", "ReduceMin"):
        # any / all: count the elements that are not the answer of an empty slice.
        hit = (lambda v: v) if op == "ReduceMax" else tvm.tirx.bitwise_not
        hits = over("hits", lambda i, k: te.sum(hit(element(i, k)).astype("int64"), axis=k))
        return te.compute(out_shape, lambda *i: (hits(*i) != 0) if op == "ReduceMax" else
                          (hits(*i) == 0), name="any" if op == "ReduceMax" else "all")
    if op == "ReduceLogSumExp":
        peak = over("peak", lambda i, k: te.max(element(i, k), axis=k))
        # te.max starts from the lowest finite float, so the peak is infinite only for a
        # slice holding +inf (or -inf everywhere with a -inf in it): shift by 0 there.
        shift = lambda i: tirx.Select(tvm.tirx.isinf(peak(*i)), tirx.const(0, x.dtype),  # noqa: E731
                                      peak(*i))
        total = over("total", lambda i, k: te.sum(tvm.tirx.exp(element(i, k) - shift(i)),
                                                  axis=k))
        return te.compute(out_shape, lambda *i: tvm.tirx.log(total(*i)) + shift(i),
                          name="log_sum_exp")
    enter, reducer = _combiner(op)
    total = over("total", lambda i, k: reducer(enter(element(i, k)), axis=k))
    if op in ("ReduceMean", "ReduceL2", "ReduceLogSum"):
        return te.compute(out_shape, lambda *i: _finish(op, total(*i), count, str(total.dtype)),
                          name="finish")
    return total


def _kept_dims(reduced: te.Tensor, shape: te.Tensor, kept: int) -> te.Tensor:
    """``shape``'s entries where ``reduced`` is 0, in order (``kept`` of them)."""
    rank = reduced.shape[0]

    def entry(position):
        found, before = tirx.IntImm("int64", 0), tirx.IntImm("int64", 0)
        for axis in range(int(rank)):
            keep = reduced[axis] == 0
            found = found + tirx.Select(tvm.tirx.all(keep, before == position), shape[axis],
                                        tirx.IntImm("int64", 0))
            before = before + tirx.Select(keep, tirx.IntImm("int64", 1), tirx.IntImm("int64", 0))
        return found

    return te.compute((kept,), entry, name="kept_dims")


def _reduce_runtime_axes(bb, op: str, data, axes, keepdims: bool) -> relax.Expr:
    """``op`` over ``axes`` known only at run time (see the module's docstring)."""
    rank, count_axes = data.ty.ndim, vector_length(axes)
    axes = int64_tensor(bb, axes)
    axes = bb.normalize(relax.op.where(relax.op.less(axes, _i64(0)),
                                       relax.op.add(axes, _i64(rank)), axes))
    hits = relax.op.equal(relax.op.expand_dims(axes, 1),
                          relax.const(list(range(rank)), "int64"))
    reduced = bb.normalize(relax.op.max(relax.op.astype(hits, "int64"), axis=0))
    bb.emit(relax.op.assert_op(
        relax.op.equal(relax.op.sum(reduced), _i64(count_axes)), [],
        f"{op}: its axes must be distinct axes of a rank-{rank} input, each in "
        f"[-{rank}, {rank - 1}]"))
    in_shape = _shape_tensor(bb, data)
    one = _i64(1)
    out_dims = shape_from(bb, bb.normalize(relax.op.where(relax.op.equal(reduced, one), one,
                                                           in_shape)), rank, f"{op}_dim")
    count = bb.normalize(relax.op.reshape(relax.op.prod(
        relax.op.where(relax.op.equal(reduced, one), in_shape, one)), [1]))
    (count,) = shape_from(bb, count, 1, f"{op}_count").values
    # The dims go in as arguments: emit_te passes those the tensors' shapes do not bind.
    out = bb.emit_te(lambda x, r, dims, n: reduce_over_runtime_axes(op, x, r, dims, n[0]),
                     data, reduced, out_dims, relax.ShapeExpr([count]),
                     primfunc_name_hint=op.lower() + "_runtime_axes")
    if keepdims:
        return out
    kept = rank - count_axes
    dims = bb.emit_te(lambda r, s: _kept_dims(r, s, kept), reduced, in_shape,
                      primfunc_name_hint="kept_dims")
    return relax.op.reshape(out, shape_from(bb, dims, kept, f"{op}_kept"))


def _constant_range(bb, value) -> relax.Expr | None:
    """``value`` as a constant when it is an ``arange`` of constant bounds (an expanded RMS
    norm's ``Range(axis, Size(Shape(x)))``, the size a constant: ``Size``), else None."""
    if isinstance(value, relax.Var):
        value = bb.lookup_binding(value)
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and
            value.op.name == "relax.arange"):
        return None
    bounds = list(value.args)
    if len(bounds) != 3 or not all(isinstance(b, tirx.IntImm) for b in bounds):
        return None
    start, limit, step = (int(b.value) for b in bounds)
    return relax.const(list(range(start, limit, step)), str(value.ty.dtype))


def _reduce_converter(base: type[tvm_onnx.OnnxOpConverter], version: int):
    """``base`` (one of TVM's ``Reduce*`` converters) with axes computed at run time taken by
    ``_reduce_runtime_axes`` in its axes-input version (``_impl_v{version}``)."""
    name = f"_impl_v{version}"

    def impl(cls, bb, inputs, attr, params):
        axes = inputs[1] if len(inputs) > 1 else None
        constant = _constant_range(bb, axes) if axes is not None else None
        if constant is not None:
            inputs, axes = [inputs[0], constant, *inputs[2:]], constant
        if axes is None or _is_known(axes, params) or not vector_length(axes) or \
                _static_rank(inputs[0]) is None:
            return getattr(super(converter, cls), name)(bb, inputs, attr, params)
        return _reduce_runtime_axes(bb, base.__name__, inputs[0], axes,
                                    bool(attr.get("keepdims", 1)))

    doc = (f"``{base.__name__}`` with its ``axes`` input (opset {version} on) computed at run "
           "time: ``_reduce_runtime_axes``.")
    converter = type(base.__name__, (base,), {name: classmethod(impl), "__doc__": doc,
                                              "__module__": __name__})
    return converter


REDUCE_CONVERTERS = {
    name: _reduce_converter(getattr(tvm_onnx, name), 13 if name == "ReduceSum" else 18)
    for name in REDUCE_OPS}
"""Every ``Reduce*`` op whose axes are an input: ReduceSum from opset 13, the others 18."""

SHAPE_TENSOR_CONVERTERS = {"Concat": Concat, "ConstantOfShape": ConstantOfShape,
                           "Gather": Gather, "Reshape": Reshape, "Size": Size,
                           **REDUCE_CONVERTERS, "Add": Add, "Sub": Sub, "Mul": Mul, "Div": Div}
"""The converters of this module, by ONNX op."""
