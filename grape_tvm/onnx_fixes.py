"""grape's fixes to TVM 0.27's Relax ONNX converters, without editing TVM.

TVM's importer looks every node's converter up in ``_get_convert_map()``, inside
``ONNXGraphImporter._convert_operator``. ``GrapeOnnxImporter`` overrides that one method:
an op listed in ``CONVERTERS`` goes to grape's converter class, every other op to TVM's.
Each converter subclasses TVM's own and handles only the case TVM gets wrong, handing the
rest back to it. docs/tvm_onnx_frontend.md reports each one upstream-style.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import tvm
from tvm import relax, tirx
from tvm.sym.analyzer import Analyzer, ConstIntBound
from tvm.relax.frontend.onnx import onnx_frontend as tvm_onnx


class OnnxConversionError(RuntimeError):
    """A converter failed: names the ONNX node and op."""


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
            raise OnnxConversionError(
                f"{op_name} node {node!r}: {text[-1] if text else type(err).__name__}") from err
        return self.bb.normalize(sym) if isinstance(sym, relax.Expr) else sym


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
    return importer.from_onnx(model.graph, default_opset(model))


def _int_scalar(value, params) -> tirx.PrimExpr | None:
    """An integer scalar known at import time, as a PrimExpr (constant or symbolic)."""
    value = tvm_onnx.get_constant(value, params)
    if isinstance(value, tvm.ir.GenericConst):
        array = value.value.numpy()
        if array.size == 1 and array.dtype.kind in "iu":
            return tirx.IntImm("int64", int(array.item()))
        return None
    if tvm.ir.is_prim_expr(value) and "int" in _scalar_dtype(value):
        return value if _scalar_dtype(value) == "int64" else tirx.Cast("int64", value)
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
    """Constant-bound ``Slice`` of a symbolic axis, proven in bounds: no clamp in the shape.

    TVM clamps each bound (``min(max(L - 1, 0), L)`` for ``x[:-1]`` on a length ``L``):
    with nothing known of ``L`` the clamp never simplifies, so Wav2Vec2's positional
    convolution (``[..., :-1]``) has a length unrelated to the sequence it is added to, and
    the sum, then every shape after it, is known by rank only (later ``Shape``/``Gather``
    fail). Here each bound is normalized (negative from the end) and, when the declared
    ranges prove it lies in ``[0, L]`` for every allowed shape, used as is.
    """

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        bounds = _constant_slice(inputs, params)
        shape = _known_shape(inputs[0])
        if bounds is None or shape is None:
            return super()._impl_v13(bb, inputs, attr, params)
        axes, starts, ends, steps = bounds
        axes = [a + len(shape) if a < 0 else a for a in axes]
        extents = [shape[a] for a in axes]
        if all(isinstance(e, tirx.IntImm) for e in extents) or any(s <= 0 for s in steps):
            return super()._impl_v13(bb, inputs, attr, params)
        analyzer = _shape_analyzer(attr["grape_dims"], *extents)
        begins = [_in_bounds(analyzer, b, e) for b, e in zip(starts, extents)]
        finals = [_in_bounds(analyzer, b, e) for b, e in zip(ends, extents)]
        if any(b is None for b in begins + finals):
            return super()._impl_v13(bb, inputs, attr, params)
        return relax.op.strided_slice(inputs[0], axes, begins, finals, steps, assume_inbound=True)


def _constant_slice(inputs, params) -> tuple[list[int], ...] | None:
    """Slice's axes, starts, ends and steps when all are constants, else None."""
    values = []
    for value in inputs[1:5]:
        value = tvm_onnx.get_constant(value, params) if value is not None else None
        if value is not None and not isinstance(value, tvm.ir.GenericConst):
            return None
        values.append(None if value is None else [int(v) for v in value.value.numpy().reshape(-1)])
    starts, ends, axes, steps = values + [None] * (4 - len(values))
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    return axes, starts, ends, steps


def _known_shape(value) -> list[tirx.PrimExpr] | None:
    ty = getattr(value, "ty", None)
    if not isinstance(ty, relax.TensorType) or ty.shape is None or \
            not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return list(ty.shape.values)


def _in_bounds(analyzer: Analyzer, bound: int, extent: tirx.PrimExpr) -> tirx.PrimExpr | None:
    """``bound`` as an index into an axis of ``extent`` (negative counts from the end), when
    it lies in ``[0, extent]`` for every shape the analyzer allows; ``extent`` itself for a
    bound past any extent (ONNX's "to the end", INT64_MAX)."""
    extent = tirx.Cast("int64", extent) if _scalar_dtype(extent) != "int64" else extent
    if bound >= 0 and analyzer.can_prove(extent <= bound):
        return extent
    index = extent + bound if bound < 0 else tirx.IntImm("int64", bound)
    index = analyzer.simplify(index)
    if analyzer.can_prove(index >= 0) and analyzer.can_prove(index <= extent):
        return index
    return None


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


CONVERTERS: dict[str, type[tvm_onnx.OnnxOpConverter]] = {
    "Clip": Clip,
    "Max": Max,
    "Min": Min,
    "Range": Range,
    "Slice": Slice,
}
