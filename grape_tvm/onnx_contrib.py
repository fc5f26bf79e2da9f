"""ONNX Runtime's normalization operators, as its transformer optimizer
(``onnxruntime.transformers.optimizer``) fuses them into BERT, ViT, BART, Whisper and
Llama exports.

* ``SkipLayerNormalization`` (com.microsoft): ``s = input + skip (+ bias)``, then a layer
  norm of ``s`` over the last axis with ``gamma`` (and ``beta``). TVM 0.27 imports it only
  with both ``beta`` and ``bias`` (BART's and Whisper's have no bias), returns 0-d zeros
  for the ``mean`` and ``inv_std_var`` outputs and omits ``input_skip_bias_sum`` (ViT's
  uses it: "Missing outputs during conversion").
* ``SkipSimplifiedLayerNormalization`` (com.microsoft): the same with an RMS norm (no mean,
  no beta): Llama's residual add and ``LlamaRMSNorm``. TVM lacks it.
* ``SimplifiedLayerNormalization`` (ONNX Runtime registers it in the default domain): an
  RMS norm over ``axis`` to the last. TVM lacks it.

    before: s = Add(Add(x, skip), bias); y = LayerNormalization(s, gamma, beta)
    ORT:    y, _, _, s = SkipLayerNormalization(x, skip, gamma, beta, bias)
    here:   s = x + skip + bias; m = mean(s, -1); i = rsqrt(mean((s - m)^2, -1) + eps)
            y = (s - m) * i * gamma + beta

The sums and statistics are computed in float32 (float64 for float64 inputs), as ONNX
Runtime computes them, and rounded once to the output's dtype; the statistics are returned
in the compute dtype (``SimplifiedLayerNormalization``'s in float32, or the input's dtype
for ``stash_type=0``). ``SkipSimplifiedLayerNormalization``'s
``mean`` output is zeros, as ONNX Runtime writes it: an RMS norm has no centering term.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as tvm_onnx

STATISTICS_DTYPE = "float32"


@dataclass(frozen=True)
class _Normalized:
    """A norm's results: ``y`` in ``gamma``'s dtype, the statistics kept as dims of 1 in
    the compute dtype."""

    y: relax.Expr
    mean: relax.Expr | None  # None for an RMS norm
    inv_std: relax.Expr


def _compute_dtype(dtype: str) -> str:
    return "float64" if dtype == "float64" else STATISTICS_DTYPE


def _widened(bb, x, dtype: str) -> relax.Expr:
    """``x`` as ``dtype`` (a cast only where it is another)."""
    x = bb.normalize(x)
    return x if str(x.ty.dtype) == dtype else bb.normalize(relax.op.astype(x, dtype))


def _normalize(bb, x, gamma, beta, axes: list[int], epsilon: float,
               centered: bool) -> _Normalized:
    """``x`` (already in the compute dtype) normalized over ``axes``: a layer norm, or an
    RMS norm when not ``centered``; scaled by ``gamma``, shifted by ``beta`` when given,
    rounded once to ``gamma``'s dtype."""
    compute = str(x.ty.dtype)
    if centered:
        mean = bb.normalize(relax.op.mean(x, axes, keepdims=True))
        deviation = bb.normalize(relax.op.subtract(x, mean))
    else:
        mean, deviation = None, x
    spread = relax.op.mean(relax.op.square(deviation), axes, keepdims=True)
    inv_std = bb.normalize(relax.op.rsqrt(relax.op.add(spread, relax.const(epsilon, compute))))
    y = relax.op.multiply(relax.op.multiply(deviation, inv_std), _widened(bb, gamma, compute))
    if beta is not None:
        y = relax.op.add(y, _widened(bb, beta, compute))
    return _Normalized(bb.normalize(_widened(bb, y, str(gamma.ty.dtype))), mean, inv_std)


def _outputs(attr: dict, values: list[relax.Expr]) -> relax.Expr:
    """The node's outputs, as many as it has (TVM checks the count)."""
    count = attr["tvm_custom"]["num_outputs"]
    return values[0] if count == 1 else relax.Tuple(values[:count])


def _skip_norm(bb, attr, x, skip, gamma, beta, bias, centered: bool) -> relax.Expr:
    """``input + skip (+ bias)`` normalized over the last axis: ``y``, ``mean`` (zeros for
    an RMS norm), ``inv_std_var`` and the sum (in the input's dtype)."""
    dtype = str(x.ty.dtype)
    compute = _compute_dtype(dtype)
    summed = relax.op.add(_widened(bb, x, compute), _widened(bb, skip, compute))
    summed = bb.normalize(summed if bias is None else
                          relax.op.add(summed, _widened(bb, bias, compute)))
    norm = _normalize(bb, summed, gamma, beta, [-1], attr.get("epsilon", 1e-12), centered)
    mean = norm.mean if centered else relax.op.zeros_like(norm.inv_std)
    return _outputs(attr, [norm.y, mean, norm.inv_std, _widened(bb, summed, dtype)])


class SkipLayerNormalization(tvm_onnx.OnnxOpConverter):
    """``input``, ``skip``, ``gamma``, optional ``beta`` and ``bias``; all four outputs."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x, skip, gamma, beta, bias = (inputs[i] for i in range(5))
        return _skip_norm(bb, attr, x, skip, gamma, beta, bias, centered=True)


class SkipSimplifiedLayerNormalization(tvm_onnx.OnnxOpConverter):
    """``input``, ``skip``, ``gamma``, optional ``bias``; an RMS norm of their sum."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x, skip, gamma, bias = (inputs[i] for i in range(4))
        return _skip_norm(bb, attr, x, skip, gamma, None, bias, centered=False)


class SimplifiedLayerNormalization(tvm_onnx.OnnxOpConverter):
    """``X``, ``scale``: an RMS norm over ``axis`` to the last; ``Y`` (in ``scale``'s dtype)
    and ``inv_std_var`` (float32, or ``X``'s dtype with ``stash_type=0``)."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x, scale = inputs[0], inputs[1]
        rank = x.ty.ndim
        axis = attr.get("axis", -1)
        if rank < 0 or not -rank <= axis < rank:
            raise ValueError(f"axis {axis} needs an input of known rank above it (rank {rank})")
        axes = list(range(axis + rank if axis < 0 else axis, rank))
        dtype = str(x.ty.dtype)
        norm = _normalize(bb, _widened(bb, x, _compute_dtype(dtype)), scale, None, axes,
                          attr.get("epsilon", 1e-5), centered=False)
        stash = dtype if attr.get("stash_type", 1) == 0 else STATISTICS_DTYPE
        return _outputs(attr, [norm.y, _widened(bb, norm.inv_std, stash)])


CONTRIB_CONVERTERS = {
    "SkipLayerNormalization": SkipLayerNormalization,
    "SkipSimplifiedLayerNormalization": SkipSimplifiedLayerNormalization,
    "SimplifiedLayerNormalization": SimplifiedLayerNormalization,
}
"""The converters of this module, by op."""
