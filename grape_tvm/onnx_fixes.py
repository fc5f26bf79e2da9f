"""grape's fixes to TVM 0.27's Relax ONNX converters, without editing TVM.

TVM's importer looks every node's converter up in ``_get_convert_map()``, inside
``ONNXGraphImporter._convert_operator``. ``GrapeOnnxImporter`` overrides that one method:
an op listed in ``CONVERTERS`` goes to grape's converter class, every other op to TVM's.
Each converter subclasses TVM's own and handles only the case TVM gets wrong, handing the
rest back to it; ``onnx_contrib``'s convert onnxruntime's normalizations whole (TVM lacks
two and imports the third partly). docs/tvm_onnx_frontend.md reports each one
upstream-style.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import tvm
from tvm import relax, tirx
from tvm.sym.analyzer import Analyzer, ConstIntBound
from tvm.relax.frontend.onnx import onnx_frontend as tvm_onnx

from grape_tvm.onnx_contrib import CONTRIB_CONVERTERS
from grape_tvm.onnx_shape_tensors import (
    REDUCE_OPS, SHAPE_TENSOR_CONVERTERS, KeepsRank, as_int64, int64_tensor, shape_from,
    vector_length)


class OnnxConversionError(RuntimeError):
    """A converter failed: names the ONNX node and op."""


class UnsupportedNode(OnnxConversionError):
    """grape refuses a node that TVM's converter would import into a wrong answer: the
    message says which configuration and why."""


class GrapeOnnxImporter(tvm_onnx.ONNXGraphImporter):
    """TVM's graph importer with grape's converters taking precedence.

    ``dims``: declared ranges of the inputs' ``dim_param`` names. grape's converters read
    them (``attrs["grape_dims"]``) to prove a slice or range in bounds for every allowed
    shape, where TVM keeps clamps that nothing downstream can simplify.
    """

    def __init__(self, dims: Mapping[str, tuple[int, int]] | None = None, **kwargs):
        super().__init__(None, "float32", **kwargs)
        self.dims = {k: (int(lo), int(hi)) for k, (lo, hi) in (dims or {}).items()}

    def _convert_operator(self, op_name: str, inputs, attrs: dict, opset: int) -> relax.Expr:
        converter = CONVERTERS.get(op_name)
        try:
            if converter is None:
                return super()._convert_operator(op_name, inputs, attrs, opset)
            attrs = {**attrs, "grape_dims": self.dims}
            sym = converter.get_converter(opset)(self.bb, inputs, attrs, [self._nodes, self._params])
        except Exception as err:  # pylint: disable=broad-except
            node = attrs.get("tvm_custom", {}).get("name") or "?"
            text = str(err).strip().splitlines()
            error = UnsupportedNode if isinstance(err, UnsupportedNode) else OnnxConversionError
            raise error(
                f"{op_name} node {node!r}: {text[-1] if text else type(err).__name__}") from err
        return self.bb.normalize(sym) if isinstance(sym, relax.Expr) else sym

    def _check_for_unsupported_ops(self, graph: onnx.GraphProto) -> None:
        """Every operator TVM's importer lacks, at once: its name, how many nodes use it and
        which (TVM names each operator once, without the nodes)."""
        known = tvm_onnx._get_convert_map()  # pylint: disable=protected-access
        missing: dict[str, list[str]] = {}
        for node in graph.node:
            if node.op_type not in known and node.op_type not in CONVERTERS and \
                    node.op_type not in ("If", "Constant"):
                name = node.name or (f"<output {node.output[0]}>" if node.output else "?")
                missing.setdefault(node.op_type, []).append(name)
        if not missing:
            return
        listed = "; ".join(
            f"{op} ({len(names)} node{'s' if len(names) > 1 else ''}: "
            f"{', '.join(repr(n) for n in names[:5])}{', ...' if len(names) > 5 else ''})"
            for op, names in sorted(missing.items()))
        raise tvm.error.OpNotImplemented(
            "The following operators are not supported for frontend ONNX: "
            f"{len(missing)} operator{'s' if len(missing) > 1 else ''}: {listed}")

    def _parse_value_proto(self, value_proto):
        """A node's name for error messages; an unnamed node (as onnx's own test models and
        many exporters write them) is named by its first output, ``<output y>``."""
        name = super()._parse_value_proto(value_proto)
        if not name and isinstance(value_proto, onnx.NodeProto) and value_proto.output:
            return f"<output {value_proto.output[0]}>"
        return name


def default_opset(model: onnx.ModelProto) -> int:
    """The model's opset of the default domain (ai.onnx)."""
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return 1


def from_onnx(model: onnx.ModelProto, dims: Mapping[str, tuple[int, int]] | None = None,
              keep_params_in_input: bool = False) -> tvm.IRModule:
    """``tvm.relax.frontend.onnx.from_onnx`` with grape's converters (no shape or dtype
    overrides: the ONNX inputs' own types and ``dim_param`` names are used). ``dims`` maps
    ``dim_param`` names to their declared ``(lo, hi)``."""
    if model.ir_version < 3:
        raise ValueError(f"ONNX IR version {model.ir_version} is too old: 3 or later is needed")
    importer = GrapeOnnxImporter(dims, keep_params_in_input=keep_params_in_input)
    model = shape_values_through_cast(empty_reduce_axes_dropped(model))
    return importer.from_onnx(model.graph, default_opset(model))


def empty_reduce_axes_dropped(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every ``Reduce*`` whose ``axes`` input is a graph input declared empty (shape
    ``[0]``) given no axes input, which the spec reads the same (reduce every axis, or
    nothing with ``noop_with_empty_axes``); on a copy, or ``model`` itself when there is
    none. The main graph's only: grape's runtime checks each of its inputs' shape against
    the declared one, so the axes fed are empty.

    TVM's importer gives a declared size of 0 a fresh symbolic size (``dim_value`` 0 reads
    as unset): the axes then look like a run-time tensor of any length, which the
    ``Reduce*`` converters cannot reduce by ("Only constant axes currently supported").
    """
    if not _empty_axes_reductions(model.graph):
        return model
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for node in _empty_axes_reductions(model.graph):
        del node.input[1]
    return model


def _empty_axes_reductions(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    initializers = {i.name for i in graph.initializer}
    empty = set()
    for value in graph.input:
        dims = value.type.tensor_type.shape.dim if value.type.HasField("tensor_type") else ()
        if value.name not in initializers and value.type.tensor_type.HasField("shape") and \
                len(dims) == 1 and dims[0].HasField("dim_value") and dims[0].dim_value == 0:
            empty.add(value.name)
    return [n for n in graph.node if n.op_type in REDUCE_OPS and n.domain in ("", "ai.onnx")
            and len(n.input) > 1 and n.input[1] in empty]


_SHAPE_COMPATIBLE = frozenset((
    "Reshape", "Resize", "ConstantOfShape", "Gather", "Slice", "Shape", "Expand", "Concat",
    "Equal", "Where", "Cast", "CastLike", "Squeeze"))
"""The ops TVM 0.27's importer lets take a shape expression (``_construct_nodes``'s
``shape_compatible_ops``); any other refuses one before its converter runs."""

_SHAPE_CARRIERS = {
    # op: the inputs whose shape value its output carries (as a shape, dim or int64 tensor)
    **{op: (0,) for op in ("Gather", "Slice", "Squeeze", "Unsqueeze", "Reshape", "Expand",
                           "Identity", "Neg", "Abs")},
    **{op: None for op in ("Concat", "Add", "Sub", "Mul", "Div", "Mod", "Max", "Min")},
    "Where": (1, 2),
}
"""Ops whose output TVM's importer may keep as a shape value (a ``ShapeExpr`` or a dim as
``PrimValue``) when the given inputs (None: any) are: the ONNX value is then int64."""


def shape_values_through_cast(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every value computed from ``Shape`` given through ``Cast(to=INT64)`` (a no-op on it:
    ONNX shapes are int64) to each node outside TVM's shape-compatible ops; on a copy,
    subgraphs included, or ``model`` itself when there is none.

    TVM's importer keeps shapes and the values computed from them (``Gather``, ``Concat``,
    ``Unsqueeze``...) as shape expressions and refuses them as the input of most ops
    ("Node ... cannot handle ShapeExpr inputs"): ``Div``/``Sub`` of a head size in the
    expansions of ``Attention``, ``Size`` of a shape in ``LayerNormalization``'s. ``Cast``
    turns a shape expression into an int64 tensor (a constant when every dim is known) and
    passes any other value on unchanged (``Cast``, same type). Which values are shape
    expressions is only known inside TVM's importer: every value that may be one gets the
    ``Cast``, and those that are not go through it untouched.
    """
    if not any(_shape_value_inputs(g) for g in subgraphs(model.graph)):
        return model
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for graph in subgraphs(model.graph):
        found = _shape_value_inputs(graph)
        if not found:
            continue
        taken = _names_in(graph)
        nodes, cast = [], {}
        for k, node in enumerate(graph.node):
            for i in found.get(k, ()):
                value = node.input[i]
                if value not in cast:
                    cast[value] = _fresh(f"{value}_as_tensor", taken)
                    nodes.append(onnx.helper.make_node("Cast", [value], [cast[value]],
                                                       name=cast[value], to=onnx.TensorProto.INT64))
                node.input[i] = cast[value]
            nodes.append(node)
        del graph.node[:]
        graph.node.extend(nodes)
    return model


def _shape_value_inputs(graph: onnx.GraphProto) -> dict[int, list[int]]:
    """For each node outside TVM's shape-compatible ops (by its index), the positions of its
    inputs that may be shape values: ``Shape``'s outputs and what ``_SHAPE_CARRIERS``
    computes from them (in this graph)."""
    shaped: set[str] = set()
    found: dict[int, list[int]] = {}
    for k, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Shape":
            shaped.update(node.output)
            continue
        carried = _SHAPE_CARRIERS.get(node.op_type, ())
        positions = range(len(node.input)) if carried is None else carried
        if any(i < len(node.input) and node.input[i] in shaped for i in positions):
            shaped.update(node.output)
        if node.op_type not in _SHAPE_COMPATIBLE:
            inputs = [i for i, name in enumerate(node.input) if name and name in shaped]
            if inputs:
                found[k] = inputs
    return found


def _names_in(graph: onnx.GraphProto) -> set[str]:
    """Every value name ``graph`` defines: node outputs, inputs, initializers."""
    return {o for n in graph.node for o in n.output} | {v.name for v in graph.input} | \
        {i.name for i in graph.initializer}


def subgraphs(graph: onnx.GraphProto):
    """``graph`` and every graph nested in its nodes' attributes (If branches, Loop bodies)."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from subgraphs(attr.g)
            for sub in attr.graphs:
                yield from subgraphs(sub)


def _fresh(name: str, taken: set[str]) -> str:
    fresh, k = name, 0
    while fresh in taken:
        k += 1
        fresh = f"{name}_{k}"
    taken.add(fresh)
    return fresh


def _int_scalar(value, params) -> tirx.PrimExpr | None:
    """An integer scalar known at import time, as a PrimExpr (constant or symbolic)."""
    value = tvm_onnx.get_constant(value, params)
    if isinstance(value, tvm.ir.GenericConst):
        array = value.value.numpy()
        if array.size == 1 and array.dtype.kind in "iu":
            return tirx.IntImm("int64", int(array.item()))
        return None
    if tvm.ir.is_prim_expr(value) and "int" in _scalar_dtype(value):
        return as_int64(value)
    return None


class Range(tvm_onnx.Range):
    """Integer ``Range`` whose bounds are shape values: the length stays a shape expression.

    TVM computes a symbolic ``start``/``limit`` range's length as a tensor and matches it to
    a fresh shape variable (``range_len_0``) that nothing relates to the model's dims: GPT-2's
    ``arange(past, past + seq)`` then broadcasts against ``past + seq`` tensors of unknown
    relation (rank-only shapes downstream), and the CUDA build fails with "range_len_0 has not
    been computed". Here the length is ``ceil((limit - start) / delta)`` on the PrimExprs
    themselves (delta a constant; the limit clamped so the length is never negative).
    """

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        start, limit, delta = (_int_scalar(x, params) for x in inputs[:3])
        if any(x is None for x in (start, limit, delta)) or not isinstance(delta, tirx.IntImm) \
                or delta.value == 0:
            return super()._impl_v12(bb, inputs, attr, params)
        dtype = _scalar_dtype(inputs[0])
        clamp = tirx.max if delta.value > 0 else tirx.min
        analyzer = _shape_analyzer(attr["grape_dims"], limit, start)
        limit = analyzer.simplify(clamp(limit, start))
        return relax.op.arange(start, limit, delta, dtype)


def _shape_analyzer(dims: Mapping[str, tuple[int, int]], *exprs: tirx.PrimExpr) -> Analyzer:
    """An analyzer that knows the shape variables in ``exprs``: their declared range, or
    non-negative."""
    analyzer = Analyzer()
    for expr in exprs:
        for var in tirx.analysis.undefined_vars(expr):
            lo, hi = dims.get(var.name, (0, ConstIntBound.POS_INF))
            analyzer.update(var, ConstIntBound(lo, hi), override=True)
    return analyzer


class Slice(tvm_onnx.Slice):
    """``Slice`` with each bound normalized by ONNX's rules before TVM sees it.

    TVM's ``strided_slice`` clamps bounds by its own rules, not ONNX's, and gets negative
    steps wrong: ``x[-2::-1]`` (end INT64_MIN) of a length-1 axis was empty (ONNX: one
    row), ``x[::-2]`` of a symbolic axis empty at every length, ``x[2:0:-1]`` given
    ``assume_inbound`` 4 rows of 3. Its clamp of a symbolic axis (``min(max(L - 1, 0), L)``
    for ``x[:-1]``) never simplifies without a range for ``L`` (Wav2Vec2's ``[..., :-1]``
    then has a length unrelated to the sequence, every later shape rank-only), and a bound
    that is a shape value takes ``assume_inbound`` with INT64_MAX in it (``x[past:]``:
    "Literal value ... exceeds range of int64").

    Here, with the axes and steps constants and the bounds constants or shape values, each
    bound is made an index by ONNX's rules (negative from the end; step > 0: clamped to
    ``[0, L]``; step < 0: the start to ``[0, L - 1]``, the end to ``[-1, L - 1]``), the clamps
    kept only where the declared ranges do not prove them, an empty range made ``begin ==
    end``. An axis with a negative step is flipped and sliced forwards (``x[s:e:-k]`` is
    ``flip(x)[L-1-s : L-1-e : k]``): TVM is given in-range bounds and positive steps only.
    Bounds computed at run time are normalized alike in tensors (``_run_time_bounds``)
    before TVM's ``dynamic_strided_slice``; a shape (``Shape``'s output) is sliced by TVM as
    a Python list.
    """

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data = inputs[0]
        shape = _known_shape(data)
        if isinstance(data, relax.ShapeExpr) or shape is None:
            return super()._impl_v13(bb, inputs, attr, params)
        known = _known_slice(inputs, params)
        if known is None:
            inputs = _run_time_bounds(bb, inputs, len(shape))
            return super()._impl_v13(bb, inputs, attr, params)
        axes, starts, ends, steps = known
        if 0 in steps:
            raise ValueError("Slice step values must be non-zero.")
        axes = [a + len(shape) if a < 0 else a for a in axes]
        extents = [as_int64(shape[a]) for a in axes]
        bounds = [b for b in starts + ends if not isinstance(b, int)]
        analyzer = _shape_analyzer(attr["grape_dims"], *extents, *bounds)
        begins, finals = [], []
        for axis, start, end, step, extent in zip(axes, starts, ends, steps, extents):
            begin, final = _forward_range(analyzer, start, end, step, extent)
            begins.append(begin)
            finals.append(final)
            if step < 0:
                data = bb.normalize(relax.op.flip(data, axis))
        return relax.op.strided_slice(data, axes, begins, finals, [abs(s) for s in steps],
                                      assume_inbound=True)


def _run_time_bounds(bb, inputs, rank: int) -> list:
    """Slice's inputs with the starts and ends, tensors computed at run time, made ONNX's
    indices (as ``_forward_range``'s, unflipped) in the form ``dynamic_strided_slice`` reads.

    TVM passes them as they are: its kernel counts ``ceil((end - begin) / step)`` elements
    unclamped, so ``x[4:2]`` allocated a negative length (``std::bad_alloc``). Here, per
    axis of length ``L``: bounds first clamped to ``[-L - 1, L]`` (no overflow after, and
    ONNX's clamps give the same), negative ones counted from the end, then step > 0:
    ``0 <= begin <= end <= L``; step < 0: ``-1 <= end <= begin <= L - 1``, an end of -1
    written ``-L - 1`` (TVM reads -1 as the last element, and clamps ``-L - 1`` to before
    the first).
    """
    data = inputs[0]
    as_int64_tensor = tvm_onnx._as_int64_tensor  # pylint: disable=protected-access
    starts, ends = (as_int64_tensor(bb, v) for v in inputs[1:3])
    count = vector_length(starts)
    if count is None:
        return inputs  # TVM's converter names it: it needs the starts' length
    axes = inputs[3] if len(inputs) > 3 and inputs[3] is not None else \
        relax.const(np.arange(count, dtype="int64"))
    steps = inputs[4] if len(inputs) > 4 and inputs[4] is not None else \
        relax.const(np.ones(count, "int64"))
    axes, steps = (as_int64_tensor(bb, v) for v in (axes, steps))
    op, i64 = relax.op, lambda v: relax.const(v, "int64")  # noqa: E731
    axes = bb.normalize(op.where(op.less(axes, i64(0)), op.add(axes, i64(rank)), axes))
    extent = bb.normalize(op.take(op.shape_to_tensor(op.shape_of(data)), axes, axis=0))
    last = bb.normalize(op.subtract(extent, i64(1)))

    def index(bound):
        bound = op.minimum(op.maximum(bound, op.subtract(i64(-1), extent)), extent)
        bound = bb.normalize(bound)
        return bb.normalize(op.where(op.less(bound, i64(0)), op.add(bound, extent), bound))

    start, end = index(starts), index(ends)  # in [-1, L]
    forward_begin = bb.normalize(op.maximum(start, i64(0)))
    forward_end = op.maximum(op.maximum(end, i64(0)), forward_begin)
    backward_begin = bb.normalize(op.maximum(op.minimum(start, last), i64(0)))
    backward_end = bb.normalize(op.minimum(op.minimum(end, last), backward_begin))
    backward_end = op.where(op.less(backward_end, i64(0)),
                            op.subtract(backward_end, extent), backward_end)
    forward = bb.normalize(op.greater(steps, i64(0)))
    return [data, bb.normalize(op.where(forward, forward_begin, backward_begin)),
            bb.normalize(op.where(forward, forward_end, backward_end)), axes, steps,
            *inputs[5:]]


def _known_slice(inputs, params) -> tuple[list, ...] | None:
    """Slice's axes and steps (ints) and starts and ends (ints or int64 PrimExprs, shape
    values) when all are known at import time, else None."""
    values = []
    for k, value in enumerate(inputs[1:5]):
        value = tvm_onnx.get_constant(value, params) if value is not None else None
        if isinstance(value, tvm.ir.GenericConst):
            values.append([int(v) for v in value.value.numpy().reshape(-1)])
        elif isinstance(value, relax.ShapeExpr) and k < 2:  # bounds computed from shapes
            values.append([_as_index(v) for v in value.values])
        elif tvm.ir.is_prim_expr(value) and "int" in _scalar_dtype(value) and k < 2:
            values.append([_as_index(value)])
        elif value is None and k >= 2:
            values.append(None)
        else:
            return None
    starts, ends, axes, steps = values + [None] * (4 - len(values))
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        return None  # TVM's converter names the mismatch
    return axes, starts, ends, steps


def _as_index(value: tirx.PrimExpr) -> int | tirx.PrimExpr:
    return int(value.value) if isinstance(value, tirx.IntImm) else as_int64(value)


def _forward_range(analyzer: Analyzer, start, end, step: int, extent: tirx.PrimExpr):
    """``[start:end:step]`` of an axis of ``extent`` as ``(begin, end)`` of a forward slice
    by ``|step|``, of the axis flipped where ``step < 0``: both in ``[0, extent]``,
    ``begin <= end``."""
    if step > 0:
        begin = _onnx_index(analyzer, start, extent, 0, extent)
        final = _onnx_index(analyzer, end, extent, 0, extent)
    else:
        last = extent - 1  # with extent 0 the start clamps to -1: begin and end are 0
        begin = analyzer.simplify(last - _onnx_index(analyzer, start, extent, 0, last))
        final = analyzer.simplify(last - _onnx_index(analyzer, end, extent, -1, last))
    return begin, analyzer.simplify(tirx.max(final, begin))


def _onnx_index(analyzer: Analyzer, bound, extent: tirx.PrimExpr, lo: int,
                hi: tirx.PrimExpr) -> tirx.PrimExpr:
    """ONNX's index of ``bound`` (an int or int64 PrimExpr) into an axis of ``extent``:
    negative counts from the end, then clamped to ``[lo, hi]``, simplified (the clamps
    vanish where the analyzer proves them)."""
    if isinstance(bound, int):
        # Far bounds (INT64_MIN/MAX: "from the start", "to the end") are decided here, in
        # Python's integers: L + INT64_MIN, or INT64_MAX as a literal, overflow TVM's.
        most = analyzer.const_int_bound(extent).max_value
        if bound >= 0 and bound >= most:
            return analyzer.simplify(hi)
        if bound < 0 and bound + most <= lo:
            return analyzer.simplify(tirx.min(tirx.IntImm("int64", lo), hi))  # hi < lo: L 0
        index = extent + bound if bound < 0 else tirx.IntImm("int64", bound)
    elif analyzer.can_prove(bound >= 0):
        index = bound
    elif analyzer.can_prove(bound < 0):
        index = extent + bound
    else:
        raise UnsupportedNode(
            f"Slice by a bound computed from shapes ({bound}) that may be negative or not "
            "is not supported: declare ranges (dims) that fix its sign")
    return analyzer.simplify(tirx.min(tirx.max(index, tirx.IntImm("int64", lo)), hi))


def _known_shape(value) -> list[tirx.PrimExpr] | None:
    ty = getattr(value, "ty", None)
    if not isinstance(ty, relax.TensorType) or ty.shape is None or \
            not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return list(ty.shape.values)


def _scalar_dtype(value) -> str:
    if tvm.ir.is_prim_expr(value):
        return str(getattr(value, "dtype", None) or value.ty)
    return str(value.ty.dtype)


class Clip(tvm_onnx.Clip):
    """``Clip`` as Relax ``maximum``/``minimum``, which grape legalizes keeping a NaN.

    TVM's converter emits TOPI's ``maximum``/``minimum`` kernels itself (``emit_te``):
    TIR's ``max`` drops a NaN, so ``Clip(NaN, -1, 1)`` is -1 where onnxruntime returns NaN.
    As Relax operators they go through ``passes/numerics.py``'s legalizations instead. A
    bound not given is the spec's default, the float type's lowest or largest finite value
    (onnxruntime clips inf to it; TVM leaves that side unclipped); a NaN bound means no
    bound (TVM's own sanitizing).
    """

    @staticmethod
    def _limits(dtype: str) -> tuple[relax.Expr | None, relax.Expr | None]:
        if dtype not in ("float16", "float32", "float64"):
            return None, None  # an integer's limits clip nothing (bfloat16: not clipped)
        info = np.finfo(dtype)
        return relax.const(float(info.min), dtype), relax.const(float(info.max), dtype)

    @classmethod
    def _clip(cls, bb, x: relax.Expr, lo: relax.Expr | None, hi: relax.Expr | None):
        for op, bound in ((relax.op.maximum, lo), (relax.op.minimum, hi)):
            if bound is not None:
                x = bb.normalize(op(x, bound))
        return x

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        dtype = str(inputs[0].ty.dtype)
        lo, hi = cls._limits(dtype)
        if "min" in attr:
            lo = relax.const(float(attr["min"]), dtype)
        if "max" in attr:
            hi = relax.const(float(attr["max"]), dtype)
        return cls._clip(bb, inputs[0], lo, hi)

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        lo, hi = cls._limits(str(inputs[0].ty.dtype))
        if inputs[1] is not None:
            lo = cls._sanitize_nan_clip_bound(bb, inputs[1], for_min=True)
        if len(inputs) > 2 and inputs[2] is not None:
            hi = cls._sanitize_nan_clip_bound(bb, inputs[2], for_min=False)
        return cls._clip(bb, inputs[0], lo, hi)


class Max(tvm_onnx.Max):
    """Element-wise ``Max`` as pairwise Relax ``maximum`` (NaN kept, as onnxruntime keeps
    it), not TVM's max reduction over a stack of the inputs, whose result depends on where
    the NaN is."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        return cls._impl_dynamic(bb, inputs)


class Min(tvm_onnx.Min):
    """Element-wise ``Min`` as pairwise Relax ``minimum`` (see ``Max``)."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        return cls._impl_dynamic(bb, inputs)


# -- wrong answers: fixed where the fix is small, else refused -------------------------------
# onnx's node test suite (python -m grape_tvm.conformance) found each of these: TVM's
# converter imports the node and the compiled model returns a wrong result. A compiler may
# refuse a model, never answer wrongly: the converters below compute the spec's result or
# raise UnsupportedNode for exactly the configurations TVM gets wrong.

def _constant_array(value, params) -> np.ndarray | None:
    """An input known at import time (a constant or an initializer), else None."""
    if value is None:
        return None
    value = tvm_onnx.get_constant(value, params)
    return value.value.numpy() if isinstance(value, tvm.ir.GenericConst) else None


def _attr_text(attr: dict, name: str, default: str) -> str:
    value = attr.get(name, default)
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


def _num_outputs(attr: dict) -> int:
    return attr["tvm_custom"]["num_outputs"]


class BatchNormalization(tvm_onnx.BatchNormalization):
    """Refused: ``training_mode=1`` with the running mean or variance as outputs.

    TVM's ``batch_norm(training=True)`` updates the running statistics with the other
    momentum convention (``momentum * batch + (1 - momentum) * running``; ONNX weighs the
    running value by ``momentum``): both outputs are wrong. ``Y`` alone, normalized with
    the batch's statistics, is right and still imported.
    """

    @classmethod
    def _impl_v15(cls, bb, inputs, attr, params):
        if attr.get("training_mode", 0) and _num_outputs(attr) > 1:
            raise UnsupportedNode(
                "BatchNormalization with training_mode=1 and running mean/var outputs is not "
                "supported: grape-tvm compiles inference graphs (TVM's update of the running "
                "statistics uses the other momentum convention)")
        return super()._impl_v15(bb, inputs, attr, params)


class BitShift(tvm_onnx.BitShift):
    """Shifts by a negative amount or by the type's width or more, as onnx specifies them.

    TVM emits a plain shift, which LLVM leaves undefined (poison) for such amounts: int32
    ``-8 << 32`` came out -8. ONNX: a left shift gives 0; a right shift gives 0, or -1 for
    a negative signed value (the sign fills every bit). The shift amount is clamped into
    range before shifting, so no undefined shift is ever emitted.
    """

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        x, shift = inputs
        if all(isinstance(v, tvm.ir.GenericConst) for v in inputs):
            return super()._impl_v11(bb, inputs, attr, params)
        dtype = str(x.ty.dtype)
        bits = tvm.DataType(dtype).bits
        zero, width = relax.const(0, dtype), relax.const(bits, dtype)
        in_range = relax.op.logical_and(relax.op.greater_equal(shift, zero),
                                        relax.op.less(shift, width))
        safe = bb.normalize(relax.op.where(in_range, shift, zero))
        if _attr_text(attr, "direction", "LEFT") == "LEFT":
            return relax.op.where(in_range, relax.op.left_shift(x, safe), zero)
        overflow = zero
        if dtype.startswith("int"):
            overflow = relax.op.right_shift(x, relax.const(bits - 1, dtype))  # 0 or -1
        return relax.op.where(in_range, relax.op.right_shift(x, safe), overflow)


_FLOAT8 = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")


def _refuse_float8_cast(op: str, source: str, target: str) -> None:
    """Refuses the casts TVM 0.27 converts wrongly on the CPU (onnx's Cast cases):

    * to float8 e4m3fn/e5m2: out-of-range values wrap instead of saturating (1e6 became
      -15 in e4m3fn; ONNX: 448, or inf/NaN with ``saturate=0``), NaN and inf are lost;
    * from float8: NaN decodes to a number (98304 from e5m2), zero to the smallest normal;
    * to float8 e8m0: ``round_mode`` is ignored (1.1 became 1.0; the default "up" gives 2).
    """
    if source in _FLOAT8 or target in _FLOAT8:
        raise UnsupportedNode(
            f"{op} from {source} to {target} is not supported: TVM's float8 conversions do "
            "not saturate, keep NaN and inf, or decode zero as ONNX specifies")
    if target == "float8_e8m0fnu":
        raise UnsupportedNode(
            f"{op} from {source} to {target} is not supported: TVM's conversion ignores "
            "round_mode")


def _dtype_of(value) -> str | None:
    ty = getattr(value, "ty", None)
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else None


class Cast(tvm_onnx.Cast):
    """Refused: casts to or from float8 (``_refuse_float8_cast``)."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        target = str(tvm_onnx.get_type(attr["to"]))
        _refuse_float8_cast("Cast", _dtype_of(inputs[0]), target)
        ty = getattr(inputs[0], "ty", None)
        if isinstance(ty, (relax.TensorType, tvm.ir.PrimType)) and str(ty.dtype) == target:
            return inputs[0]  # the identity; keeps a dim (PrimValue) a dim
        return super()._impl_v13(bb, inputs, attr, params)


class CastLike(tvm_onnx.CastLike):
    """Refused: casts to or from float8 (``_refuse_float8_cast``)."""

    @classmethod
    def _impl_v15(cls, bb, inputs, attr, params):
        _refuse_float8_cast("CastLike", _dtype_of(inputs[0]), _dtype_of(inputs[1]))
        return super()._impl_v15(bb, inputs, attr, params)


class Conv(tvm_onnx.Conv):
    """float16 and bfloat16 ``Conv`` accumulated in float32, rounded once at the end.

    TVM's convolution accumulates in the input type: a float16 depthwise ``Conv`` of onnx's
    ``CausalConvWithState`` (silu, float16) came out 3 units in the last place from the
    expected output, beyond its tolerance (onnxruntime: 1 unit). Here the convolution's
    ``out_dtype`` is float32 and the bias is added in float32 before the one rounding.
    """

    _OPS = {"relax.nn.conv1d": relax.op.nn.conv1d, "relax.nn.conv2d": relax.op.nn.conv2d,
            "relax.nn.conv3d": relax.op.nn.conv3d}

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        dtype = _dtype_of(inputs[0])
        out = super()._impl_v11(bb, inputs, attr, params)
        if dtype not in ("float16", "bfloat16"):
            return out
        conv = out.args[0] if inputs[2] is not None else out
        if not isinstance(conv, relax.Call) or getattr(conv.op, "name", None) not in cls._OPS:
            return out
        a = conv.attrs
        wide = bb.normalize(cls._OPS[conv.op.name](
            conv.args[0], conv.args[1], strides=a.strides, padding=a.padding,
            dilation=a.dilation, groups=a.groups, data_layout=a.data_layout,
            kernel_layout=a.kernel_layout, out_layout=a.out_layout, out_dtype="float32"))
        if inputs[2] is not None:
            bias = relax.op.reshape(bb.normalize(relax.op.astype(inputs[2], "float32")),
                                    [1, -1] + [1] * (conv.args[0].ty.ndim - 2))
            wide = bb.normalize(relax.op.add(wide, bias))
        return relax.op.astype(wide, dtype)


class ConvTranspose(tvm_onnx.ConvTranspose):
    """``output_shape`` turned into ``pads`` (and ``output_padding``), as the spec says.

    TVM's converter ignores ``output_shape``: a (3, 3) input with strides (3, 2) and
    ``output_shape`` (10, 8) came out (9, 7). The spec derives the padding from it:
    ``total = stride * (in - 1) + output_padding + (kernel - 1) * dilation + 1 - out``,
    split between the ends by ``auto_pad`` (SAME_UPPER puts the larger half at the end);
    an output larger than the unpadded one (``total < 0``) is extra ``output_padding``, as
    onnxruntime computes it.
    """

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        if "output_shape" not in attr:
            return super()._impl_v1(bb, inputs, attr, params)
        spatial = list(inputs[0].ty.shape.values)[2:]
        if not all(isinstance(d, tirx.IntImm) for d in spatial):
            raise UnsupportedNode("ConvTranspose with output_shape on a symbolic input shape is "
                                  "not supported: its padding depends on the input size")
        auto_pad = _attr_text(attr, "auto_pad", "NOTSET")
        attr = {k: v for k, v in attr.items() if k != "auto_pad"}
        attr["pads"], attr["output_padding"] = cls._padding_for(
            [int(d) for d in spatial], inputs[1], attr, auto_pad)
        del attr["output_shape"]
        return super()._impl_v1(bb, inputs, attr, params)

    @staticmethod
    def _padding_for(sizes: list[int], weight, attr: dict, auto_pad: str):
        n = len(sizes)
        kernel = list(attr.get("kernel_shape") or [int(k) for k in weight.ty.shape.values[2:]])
        strides = list(attr.get("strides", [1] * n))
        dilations = list(attr.get("dilations", [1] * n))
        extra = list(attr.get("output_padding", [0] * n))
        begins, ends = [], []
        for i, out in enumerate(attr["output_shape"][-n:]):
            total = strides[i] * (sizes[i] - 1) + extra[i] + (kernel[i] - 1) * dilations[i] + 1 - out
            if total < 0:
                extra[i] -= total
                total = 0
            small = total // 2
            begins.append(small if auto_pad == "SAME_UPPER" else total - small)
            ends.append(total - begins[-1])
        return begins + ends, extra


def _is_constant_false(value, params) -> bool:
    """A constant all false (or 0), known at import time."""
    array = _constant_array(value, params)
    return array is not None and not array.any()


class Dropout(tvm_onnx.Dropout):
    """Inference Dropout: ``y = x`` and an all-true bool mask; training mode refused.

    TVM's ``nn.dropout`` returns its mask as float32 (ONNX, opset 10 on: bool) and ignores
    the ``training_mode`` input, returning ``x`` where ONNX drops elements at random. A
    random output cannot be compiled to match anything: training mode with a ratio above 0
    is refused at import when both are constants, and raises at run time when either is
    an input (a run-time ``training_mode`` false, or ratio 0, is the plain ``y = x``).
    """

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        return relax.Tuple([inputs[0], relax.op.ones_like(inputs[0], "bool")])

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        ratio = inputs[1] if len(inputs) > 1 else None
        training = inputs[2] if len(inputs) > 2 else None
        if training is not None and not _is_constant_false(training, params) and \
                not _is_constant_false(ratio, params):
            cls._refuse_training(bb, training, ratio, params, attr["tvm_custom"]["name"])
        return cls._impl_v10(bb, inputs, attr, params)

    @staticmethod
    def _refuse_training(bb, training, ratio, params, node: str) -> None:
        why = ("Dropout with training_mode true and a ratio above 0 is not supported: its output "
               "is random in training (grape-tvm compiles inference graphs)")
        if _constant_array(training, params) is not None and \
                (ratio is None or _constant_array(ratio, params) is not None):
            raise UnsupportedNode(why)
        dropping = relax.op.astype(training, "bool")
        if ratio is not None:
            dropping = relax.op.logical_and(
                dropping, relax.op.greater(ratio, relax.const(0, str(ratio.ty.dtype))))
        bb.emit(relax.op.assert_op(relax.op.logical_not(dropping), [],
                                   f"Dropout node {node!r}: {why}"))


class Expand(tvm_onnx.Expand):
    """``Expand`` by ONNX's multidirectional broadcasting, whatever gives the shape.

    TVM broadcasts the input *to* the shape with ``broadcast_to``, whose legalization reads
    ``x[i]`` along a symbolic input dim, taking it for the output's: ``Expand(x[n, 4],
    Shape(y[m, 4]))`` read past ``x`` at n = 1, m = 3 (garbage), and a 1 in a symbolic
    shape kept it ((1, 4) at n = 3, m = 1; ``Expand(x[n, 1], s)``, ``s`` a run-time
    ``[2, 3, 1]``, read ``x[1]`` of one row at n = 1). A constant shape with a symbolic
    input dim failed ("'Var' object has no attribute 'value'"), and so did a shape shorter
    than the input (an AssertionError; ONNX pads the shorter side).

    Here the shape's elements are dims (a constant, a shape expression, a tensor read back
    as one, or a run-time tensor matched to fresh dims); both sides are padded to the
    larger rank, and each pair gives the non-1 of the two, read at index 0 along an input
    dim of 1 (``_broadcast_pair``). A pair the declared ranges cannot decide is
    ``select(d == 1, t, d)``, read at ``select(d == 1, 0, i)`` by grape's own kernel
    (``_expand``), and checked at run time (``_check_broadcast``). Where every input dim is
    1 or the output's own, TVM's ``broadcast_to`` is right and kept (or the input itself).
    """

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, shape = inputs
        data_shape = _known_shape(data)
        target = None if data_shape is None else _expand_target(bb, shape, params)
        if target is None:
            return super()._impl_v13(bb, inputs, attr, params)
        target, from_tensor = target
        rank = max(len(data_shape), len(target))
        one = tirx.IntImm("int64", 1)
        padded = [one] * (rank - len(data_shape)) + [as_int64(d) for d in data_shape]
        target = [one] * (rank - len(target)) + target
        # A run-time tensor's dims are any int64: the analyzer must not take them as >= 0.
        known = padded + ([] if from_tensor else target)
        analyzer = _shape_analyzer(attr["grape_dims"], *known)
        pairs = [_broadcast_pair(analyzer, d, t) for d, t in zip(padded, target)]
        out_shape = [out for out, _, _ in pairs]
        _check_broadcast(bb, analyzer, [c for _, _, c in pairs],
                         attr["tvm_custom"]["name"], padded, target)
        if all(_plainly_broadcast(d, out) for d, out in zip(padded, out_shape)):
            if len(data_shape) == rank and all(d.same_as(out) or _equal_constants(d, out)
                                               for d, out in zip(padded, out_shape)):
                return data
            return relax.op.broadcast_to(data, relax.ShapeExpr(out_shape))
        return bb.emit_te(_expand, data, out_shape, [zero for _, zero, _ in pairs],
                          primfunc_name_hint="expand")


def _expand_target(bb, shape, params) -> tuple[list[tirx.PrimExpr], bool] | None:
    """``Expand``'s shape as int64 dims, and whether they come from a run-time tensor
    (matched to fresh dims); None where it is not a 1-d tensor of known length."""
    if isinstance(shape, relax.ShapeExpr):
        return [as_int64(t) for t in shape.values], False
    array = _constant_array(shape, params)
    if array is not None:
        return [tirx.IntImm("int64", int(t)) for t in array.reshape(-1)], False
    values = _shape_values(bb, shape)
    if values is not None:
        return [as_int64(t) for t in values], False
    length = vector_length(shape)
    if length is None:
        return None
    return list(shape_from(bb, int64_tensor(bb, shape), length, "expand_dim").values), True


def _broadcast_pair(analyzer: Analyzer, d: tirx.PrimExpr, t: tirx.PrimExpr
                    ) -> tuple[tirx.PrimExpr, tirx.PrimExpr, tirx.PrimExpr | None]:
    """An input dim ``d`` and a shape dim ``t`` broadcast: the output dim, when to read the
    input at index 0 (a bool), and what must hold at run time (None: proven)."""
    false, true = tirx.const(False), tirx.const(True)
    if isinstance(t, tirx.IntImm) and t.value == -1:
        return d, false, None  # TVM's reading of -1 (the input's dim), kept
    if isinstance(t, tirx.IntImm) and t.value < 0:
        raise ValueError(f"Expand: a negative dim {t.value} in the shape")
    if analyzer.can_prove_equal(t, 1) or analyzer.can_prove_equal(d, t):
        return d, false, None
    if analyzer.can_prove_equal(d, 1):
        return t, true, (None if analyzer.can_prove(t >= 0) else t >= 0)
    if isinstance(d, tirx.IntImm) and isinstance(t, tirx.IntImm):
        raise ValueError(f"Expand: an input dim of {d.value} does not broadcast with "
                         f"{t.value} (ONNX needs them equal or one of them 1)")
    is_one = analyzer.simplify(d == 1)
    # A constant shape dim is the output's wherever the pair broadcasts (checked below).
    out = t if isinstance(t, tirx.IntImm) else analyzer.simplify(tirx.Select(is_one, t, d))
    holds = analyzer.simplify(tirx.all(t >= 0, tirx.any(is_one, t == 1, d == t)))
    return out, is_one, (None if analyzer.can_prove(holds) else holds)


def _check_broadcast(bb, analyzer: Analyzer, checks, node: str, padded, target) -> None:
    """Fails the run where a pair of dims the import could not decide does not broadcast
    (onnxruntime refuses it): read unchecked, the kernel reads past the input. The message
    gives both shapes' values at run time."""
    checks = [c for c in checks if c is not None]
    if not checks:
        return
    holds = analyzer.simplify(tirx.all(*checks)) if len(checks) > 1 else checks[0]
    dims = ", ".join(["{}"] * len(padded))
    node = node.replace("{", "{{").replace("}", "}}")
    bb.emit(relax.op.assert_op(
        holds, [relax.prim_value(d) for d in padded + target],
        f"Expand node {node!r}: an input of shape ({dims}) does not broadcast with the shape "
        f"({dims}) (each pair of dims must be equal, or one of them 1)"))


def _plainly_broadcast(d: tirx.PrimExpr, out: tirx.PrimExpr) -> bool:
    """What TVM's ``broadcast_to`` reads right: an input dim of 1 (read at 0) or the output's
    own dim (read at i)."""
    return (isinstance(d, tirx.IntImm) and d.value == 1) or d.same_as(out) or \
        _equal_constants(d, out)


def _equal_constants(a: tirx.PrimExpr, b: tirx.PrimExpr) -> bool:
    return isinstance(a, tirx.IntImm) and isinstance(b, tirx.IntImm) and a.value == b.value


def _expand(x: tvm.te.Tensor, out_shape, zero_if) -> tvm.te.Tensor:
    """``x`` broadcast to ``out_shape``: along each of its dims read at 0 where ``zero_if``
    (its dim is 1, perhaps known only at run time), else at the output's index."""
    lead = len(out_shape) - len(x.shape)
    zero = tirx.IntImm("int64", 0)

    def element(*index):
        read = []
        for i, z in zip(index[lead:], zero_if[lead:]):
            if isinstance(z, tirx.IntImm):
                read.append(zero if z.value else i)
            else:
                read.append(tirx.Select(z, zero, i))
        return x(*read)

    return tvm.te.compute(out_shape, element, name="expand")


class Tile(tvm_onnx.Tile):
    """``Tile`` by repeats computed from shapes: the output's shape a shape expression.

    With repeats that are not a constant, TVM tiles with ``dyn_tile`` into a shape of fresh
    variables (``tile_dim_0``...) that nothing relates to the dims the repeats came from:
    Whisper's position ids tiled by ``[batch, 1]`` are then added to ``[batch, 1, d]``
    embeddings of unrelated shape. Repeats read back as shape expressions (a
    ``shape_to_tensor``, which ``shape_values_through_cast`` arranges for) give the output
    shape ``[r0 * d0, r1 * d1, ...]`` itself, computed as ONNX says: element ``i`` of an
    axis of ``d`` is ``x[i % d]``: one injective kernel, which fuses with its neighbours.
    Repeats given as constants or graph inputs keep TVM's converter.
    """

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, repeats = inputs
        shape, values = _known_shape(data), _shape_values(bb, repeats)
        if shape is None or values is None:
            return super()._impl_v13(bb, inputs, attr, params)
        rank = max(len(shape), len(values))
        one = tirx.IntImm("int64", 1)
        shape = [as_int64(d) for d in shape]
        padded = [one] * (rank - len(shape)) + shape
        values = [one] * (rank - len(values)) + [as_int64(r) for r in values]
        analyzer = _shape_analyzer(attr["grape_dims"], *padded, *values)
        out_shape = [analyzer.simplify(r * d) for r, d in zip(values, padded)]

        def tile(x):
            def element(*index):
                index = index[rank - len(shape):]
                return x(*[tirx.IntImm("int64", 0) if isinstance(d, tirx.IntImm) and d.value == 1
                           else tirx.floormod(i, d) for i, d in zip(index, shape)])
            return tvm.te.compute(out_shape, element, name="tile")

        return bb.emit_te(tile, data)


def _shape_values(bb, value) -> list[tirx.PrimExpr] | None:
    """The elements of a 1-d integer tensor made from a shape expression
    (``shape_to_tensor``, perhaps through ``astype``), else None."""
    seen = 0
    while isinstance(value, relax.Var) and seen < 8:
        seen += 1
        bound = bb.lookup_binding(value)
        if bound is None:
            return None
        value = bound
    if isinstance(value, relax.ShapeExpr):
        return list(value.values)
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and \
            value.op.name in ("relax.shape_to_tensor", "relax.astype"):
        arg = value.args[0]
        if value.op.name == "relax.astype" and "int" not in str(value.ty.dtype):
            return None
        ty = getattr(arg, "ty", None)
        if isinstance(ty, relax.ShapeType) and ty.values is not None:
            return list(ty.values)
        return _shape_values(bb, arg)
    return None


class IsInf(tvm_onnx.IsInf):
    """``detect_positive``/``detect_negative``, which TVM ignores (it flags both signs)."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        x = inputs[0]
        found = relax.op.isinf(x)
        zero = relax.const(0, str(x.ty.dtype))
        if not attr.get("detect_positive", 1):
            found = relax.op.logical_and(found, relax.op.less(x, zero))
        if not attr.get("detect_negative", 1):
            found = relax.op.logical_and(found, relax.op.greater(x, zero))
        return found


class LayerNormalization(tvm_onnx.LayerNormalization):
    """The ``Mean`` and ``InvStdDev`` outputs, which TVM returns as 0-d placeholders.

    Both are over the normalized axes (``axis`` to the last), kept as dims of 1, in
    ``stash_type``'s precision (float32 by default). Unused, they are removed as dead code.
    """

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        normalized = super()._impl_v17(bb, inputs, attr, params)
        if _num_outputs(attr) == 1:
            return normalized  # TVM's own, where only Y is used
        y = bb.normalize(normalized[0])
        x = inputs[0]
        rank = x.ty.ndim
        axis = attr.get("axis", -1)
        axes = list(range(axis + rank if axis < 0 else axis, rank))
        stash = str(tvm_onnx.get_type(attr.get("stash_type", onnx.TensorProto.FLOAT)))
        x = relax.op.astype(x, stash) if str(x.ty.dtype) != stash else x
        mean = bb.normalize(relax.op.mean(x, axes, keepdims=True))
        variance = relax.op.mean(relax.op.square(relax.op.subtract(x, mean)), axes, keepdims=True)
        epsilon = relax.const(attr.get("epsilon", 1e-5), stash)
        return relax.Tuple([y, mean, relax.op.rsqrt(relax.op.add(variance, epsilon))])


class Mish(tvm_onnx.Mish):
    """``x * tanh(softplus(x))`` as ``x * n / (n + 2)``, ``n = e^x (e^x + 2)``.

    TVM's ``x * tanh(log(1 + e^x))`` loses ``e^x`` in ``1 + e^x`` for negative ``x`` (an
    error of 5.8e-7 at x = -10, where Mish is -4.5e-4). The identity
    ``tanh(log(1 + e)) = e (e + 2) / (e (e + 2) + 2)`` has no such cancellation. ``x`` is
    capped at 20 inside the exponential (``n / (n + 2)`` is then 1 to the last bit) and
    float16 is computed in float32, so ``n`` never overflows.
    """

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        x = inputs[0]
        dtype = str(x.ty.dtype)
        compute = "float32" if dtype == "float16" else dtype
        wide = relax.op.astype(x, compute) if compute != dtype else x
        e = bb.normalize(relax.op.exp(relax.op.minimum(wide, relax.const(20.0, compute))))
        n = bb.normalize(relax.op.multiply(e, relax.op.add(e, relax.const(2.0, compute))))
        y = relax.op.divide(relax.op.multiply(wide, n), relax.op.add(n, relax.const(2.0, compute)))
        return relax.op.astype(y, dtype) if compute != dtype else y


class Mod(KeepsRank, tvm_onnx.Mod):
    """Float ``Mod`` with ``fmod=0`` (Python's ``%``) at infinities.

    TVM computes ``x - floor(x / y) * y``: ``-3 % inf`` is NaN (``floor(-0) * inf``), where
    numpy and onnxruntime give inf. Here the truncated remainder ``r = fmod(x, y)`` (exact,
    and right at infinities) is moved into ``y``'s sign: ``r + y`` when ``r`` is nonzero
    and its sign differs from ``y``'s. A dim with one-element constants keeps their rank
    (``KeepsRank``).
    """

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        x, y = inputs
        dtype = _dtype_of(x)
        if attr.get("fmod", 0) or dtype is None or not dtype.startswith(("float", "bfloat")) or \
                all(isinstance(v, tvm.ir.GenericConst) for v in inputs):
            return super()._impl_v10(bb, inputs, attr, params)
        zero = relax.const(0, dtype)
        r = bb.normalize(relax.op.mod(x, y))
        signs_differ = relax.op.logical_xor(relax.op.less(r, zero), relax.op.less(y, zero))
        move = relax.op.logical_and(relax.op.not_equal(r, zero), signs_differ)
        return relax.op.where(move, relax.op.add(r, y), r)


class NonMaxSuppression(tvm_onnx.NonMaxSuppression):
    """Refused: ``max_output_boxes_per_class``, ``iou_threshold`` or ``score_threshold``
    given by a tensor not known at import time.

    TVM's converter needs them as constants and, for any other input, silently takes 0
    boxes, IoU 0.5 and score 0: every such model returned no boxes.
    """

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        names = ("max_output_boxes_per_class", "iou_threshold", "score_threshold")
        for name, value in zip(names, inputs[2:5]):
            if value is not None and _constant_array(value, params) is None:
                raise UnsupportedNode(
                    f"NonMaxSuppression with a {name} computed at run time is not supported: "
                    "TVM's converter needs it as a constant (an initializer)")
        return super()._impl_v10(bb, inputs, attr, params)


class RoiAlign(tvm_onnx.RoiAlign):
    """Refused: ``mode="max"``. TVM takes the maximum over the bilinear samples; onnx and
    onnxruntime take, for each sample, the maximum of its four weighted neighbours (71 of
    75 values differed in onnx's case)."""

    @classmethod
    def _impl(cls, bb, inputs, attr, params, default_coordinate_transformation_mode):
        if _attr_text(attr, "mode", "avg") == "max":
            raise UnsupportedNode('RoiAlign with mode="max" is not supported: TVM pools the '
                                  "bilinear samples, not onnx's weighted neighbours")
        return super()._impl(bb, inputs, attr, params, default_coordinate_transformation_mode)


class Resize(tvm_onnx.Resize):
    """Refused: constant ``scales`` whose product with a dim is not an integer for every
    allowed shape, where the coordinate transform reads the scale.

    TVM turns scales into sizes (``floor(scale * dim)``) and its kernels map coordinates by
    ``in / out``; ONNX maps them by the given scale (``(x + 0.5) / scale - 0.5`` for
    half_pixel): where ``scale * dim`` is not an integer the two differ (``[2, 3]`` by
    1.5 with mode linear: values off by 0.21). TVM's resize has no way to take the scale,
    so those are refused; integer products (2 on any dim, 0.5 on an even static one) and
    the transforms that read only lengths (align_corners, tf_crop_and_resize) are TVM's.
    Scales other than 1 on the batch or channel axis, which TVM drops, are refused too.
    """

    _LENGTHS_ONLY = ("align_corners", "tf_crop_and_resize")

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        scales = _constant_array(inputs[2], params) if len(inputs) > 2 and \
            inputs[2] is not None else None
        shape = _known_shape(inputs[0])
        if scales is not None and scales.size and shape is not None:
            mode = _attr_text(attr, "coordinate_transformation_mode", "half_pixel")
            for axis, (scale, dim) in enumerate(zip(scales.tolist(), shape)):
                cls._check(axis, float(scale), dim, mode)
        return super()._impl_v18(bb, inputs, attr, params)

    @classmethod
    def _check(cls, axis: int, scale: float, dim: tirx.PrimExpr, mode: str) -> None:
        """Raises for a scale TVM would apply wrongly (the importer names the node)."""
        size = int(dim) if isinstance(dim, tirx.IntImm) else dim
        where = f"axis {axis}: scale {scale:g} of dim {size}"
        if axis < 2 and scale != 1:
            raise UnsupportedNode(f"Resize of the batch or channel axis is not supported "
                                  f"({where}): TVM resizes the spatial axes only")
        if axis < 2 or mode in cls._LENGTHS_ONLY or _integer_product(scale, dim):
            return
        raise UnsupportedNode(
            f"Resize by a scale whose product with the dim is not an integer is not "
            f"supported ({where}, coordinate_transformation_mode {mode}): TVM maps "
            "coordinates by the sizes' ratio, ONNX by the scale")


def _integer_product(scale: float, dim: tirx.PrimExpr) -> bool:
    """``scale * dim`` an integer for every value of ``dim``: a static dim, or an integer
    scale. The float32 scale is taken to a relative 1e-6 (0.3f * 10 is 3.0000001, which ONNX
    floors to 3; the ratio TVM uses is then the scale to that precision)."""
    if not isinstance(dim, tirx.IntImm):
        return float(scale).is_integer()
    product = scale * int(dim)
    return product - np.floor(product) <= 1e-6 * max(1.0, product)


class Softplus(tvm_onnx.Softplus):
    """``log(1 + e^x)`` accurate where ``e^x`` is small against 1.

    TVM's ``max(x, 0) + log(1 + e^-|x|)`` rounds ``1 + e`` to float first: at x = -10 the
    result is off by 0.1% (onnx's ``Mish`` expansion, ``x * tanh(softplus(x))``, missed its
    tolerance there). ``log1p(e)`` is computed as ``log(u) * e / (u - 1)``, ``u = 1 + e``
    (Goldberg's form: the rounding of ``u`` cancels), ``e`` itself where ``u`` rounds to 1.
    """

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x = inputs[0]
        dtype = str(x.ty.dtype)
        zero, one = relax.const(0, dtype), relax.const(1, dtype)
        e = bb.normalize(relax.op.exp(relax.op.negative(relax.op.abs(x))))
        u = bb.normalize(relax.op.add(one, e))
        d = bb.normalize(relax.op.subtract(u, one))
        log1p = relax.op.where(relax.op.equal(d, zero), e,
                               relax.op.divide(relax.op.multiply(relax.op.log(u), e), d))
        return relax.op.add(relax.op.maximum(x, zero), log1p)


class SpaceToDepth(tvm_onnx.SpaceToDepth):
    """``mode="CRD"`` (opset 25 on), which TVM ignores: it always orders the output channels
    ``(block row, block column, channel)`` (DCR); CRD orders them ``(channel, block row,
    block column)``."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        if _attr_text(attr, "mode", "DCR") != "CRD":
            return super()._impl_v1(bb, inputs, attr, params)
        size = int(attr["blocksize"])
        b, c, h, w = inputs[0].ty.shape
        x = relax.op.reshape(inputs[0], (b, c, h // size, size, w // size, size))
        x = relax.op.permute_dims(x, [0, 1, 3, 5, 2, 4])
        return relax.op.reshape(x, (b, c * size * size, h // size, w // size))


CONVERTERS: dict[str, type[tvm_onnx.OnnxOpConverter]] = {
    "BatchNormalization": BatchNormalization,
    "BitShift": BitShift,
    "Cast": Cast,
    "CastLike": CastLike,
    "Clip": Clip,
    "Conv": Conv,
    "ConvTranspose": ConvTranspose,
    "Dropout": Dropout,
    "Expand": Expand,
    "IsInf": IsInf,
    "LayerNormalization": LayerNormalization,
    "Max": Max,
    "Min": Min,
    "Mish": Mish,
    "Mod": Mod,
    "NonMaxSuppression": NonMaxSuppression,
    "Range": Range,
    "Resize": Resize,
    "RoiAlign": RoiAlign,
    "Slice": Slice,
    "Softplus": Softplus,
    "SpaceToDepth": SpaceToDepth,
    "Tile": Tile,
    **SHAPE_TENSOR_CONVERTERS,
    **CONTRIB_CONVERTERS,
}
"""Every ONNX op whose conversion grape changes: a fix of TVM's converter, a refusal of
the configurations it imports into wrong answers (``UnsupportedNode``), or a converter of
an op TVM lacks (``onnx_contrib``)."""
