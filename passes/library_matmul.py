"""Matmuls with a weight of static shape become calls of cuBLASLt, through grape's runtime."""

from __future__ import annotations

from tvm import relax, tirx
from tvm.ir import IRModule
from tvm.ir.transform import PassContext
from tvm.relax.dpl import is_op, wildcard
from tvm.relax.dpl import rewrite_call
from tvm.relax.transform import function_pass

from grape_tvm.runtime.cublaslt import EPILOGUES, MatmulFunction

LIBRARY_DTYPES = ("float32", "float16", "bfloat16")
# Activations cuBLASLt's epilogue computes as the model does. ReLU is not one of them:
# cuBLASLt's turns NaN into 0, grape's ReLU keeps it, as onnxruntime does (passes/numerics.py).
_ACTIVATIONS = {"relax.nn.gelu_tanh": "gelu"}


def _static_dims(ty) -> list[int] | None:
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    dims = ty.shape.values
    return [int(d) for d in dims] if all(isinstance(d, tirx.IntImm) for d in dims) else None


def _weight(w: relax.Expr) -> tuple[relax.Expr, bool] | None:
    """The weight as stored, and whether the model uses it transposed ([N, K] stored)."""
    if isinstance(w, relax.Call) and getattr(w.op, "name", "") == "relax.permute_dims":
        axes = w.attrs.axes
        if axes is None or [int(a) for a in axes] == [1, 0]:
            return w.args[0], True
        return None
    return w, False


class _Match:
    """What a matched pattern binds: x, the weight, and the bias and activation if any."""

    def __init__(self, matched: dict, root_pattern):
        self.x = matched[_X]
        self.w = matched[_W]
        self.bias = matched.get(_B)
        self.activation = None
        root = matched[root_pattern]
        if isinstance(root, relax.Call) and root.op.name in _ACTIVATIONS:
            self.activation = _ACTIVATIONS[root.op.name]


def _rewrite(root, matched: dict, root_pattern) -> relax.Expr:
    match = _Match(matched, root_pattern)
    x_ty, out_ty = match.x.ty, root.ty
    dtype = str(out_ty.dtype)
    weight = _weight(match.w)
    if weight is None or dtype not in LIBRARY_DTYPES or str(x_ty.dtype) != dtype:
        return root
    stored, transposed = weight
    w_dims = _static_dims(stored.ty)
    if w_dims is None or len(w_dims) != 2 or str(stored.ty.dtype) != dtype:
        return root
    n, k = w_dims if transposed else w_dims[::-1]
    if x_ty.ndim < 2 or not isinstance(x_ty.shape.values[-1], tirx.IntImm) or \
            int(x_ty.shape.values[-1]) != k:
        return root
    args = [match.x, stored]
    epilogue = ""
    if match.bias is not None:
        if _static_dims(match.bias.ty) != [n] or str(match.bias.ty.dtype) != dtype:
            return root
        args.append(match.bias)
        epilogue = "bias"
    if match.activation:
        epilogue = f"{epilogue}_{match.activation}" if epilogue else match.activation
    assert epilogue in EPILOGUES
    function = MatmulFunction(epilogue, transposed)
    return relax.op.call_dps_packed(function.name, relax.Tuple(args),
                                    relax.TensorType(out_ty.shape, dtype))


_X, _W, _B = wildcard(), wildcard(), wildcard()
_MATMUL = is_op("relax.matmul")(_X, _W)
_BIASED = is_op("relax.add")(_MATMUL, _B) | is_op("relax.add")(_B, _MATMUL)
# Largest first: an epilogue is fused only where the whole chain matches.
PATTERNS = [is_op(op)(_BIASED) for op in _ACTIVATIONS] + [_BIASED] + \
    [is_op(op)(_MATMUL) for op in _ACTIVATIONS] + [_MATMUL]


@function_pass(opt_level=0, name="OffloadMatmul")
class OffloadMatmul:
    """Rewrite ``matmul(x, w)`` (w a 2-D weight of static shape, stored [K, N] or used
    transposed from [N, K]; x of any rank, its rows symbolic), with a bias add and a
    tanh-GELU after it where present, into one call of a cuBLASLt function of grape's
    runtime (``runtime/cublaslt.py``: the function's name says its epilogue). The call is a
    kernel launch for ``LiftGraphRegions``: captured into the region's graph.

    Matmuls of two activations (attention scores), of other dtypes, or whose out dtype
    differs from their inputs', stay TVM's.

    Before::

        lv = R.matmul(x, w)                  # x: (n, 768), w: (768, 3072)
        lv1 = R.add(lv, b)                   # b: (3072,)
        y = R.nn.gelu_tanh(lv1)

    After::

        y = R.call_dps_packed("grape.cublaslt.matmul_bias_gelu", (x, w, b),
                              out_ty=R.Tensor((n, 3072), "float32"))
    """

    def transform_function(self, func: relax.Function, mod: IRModule,
                           ctx: PassContext) -> relax.Function:
        for pattern in PATTERNS:
            func = rewrite_call(pattern, lambda root, matched, p=pattern: _rewrite(root, matched, p),
                                func)
        return func
