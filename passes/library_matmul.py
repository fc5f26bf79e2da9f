"""Matmuls with a weight of static shape become calls of cuBLASLt, through grape's runtime."""

from __future__ import annotations

from tvm import relax, tirx
from tvm.ir import IRModule
from tvm.ir.transform import PassContext
from tvm.relax.dpl import is_op, wildcard
from tvm.relax.dpl import rewrite_call
from tvm.relax.transform import function_pass

from grape_tvm.runtime.cublaslt import EPILOGUES, MatmulFunction

from .if_to_select import same_dims

LIBRARY_DTYPES = ("float32", "float16", "bfloat16")
# Activations cuBLASLt's epilogue computes as the model does. ReLU is not one of them:
# cuBLASLt's turns NaN into 0, grape's ReLU keeps it, as onnxruntime does (passes/numerics.py).
_ACTIVATIONS = {"relax.nn.gelu_tanh": "gelu"}


def _static_dims(ty) -> list[int] | None:
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    dims = ty.shape.values
    return [int(d) for d in dims] if all(isinstance(d, tirx.IntImm) for d in dims) else None


def _stored(w: relax.Expr) -> tuple[relax.Expr, bool]:
    """The operand as stored, and whether the model uses it transposed: ``w`` is
    ``permute_dims`` swapping its last two axes (a 2-D weight stored [N, K], or k of
    attention's ``q @ k^T``), read in place by cuBLASLt."""
    if isinstance(w, relax.Call) and getattr(w.op, "name", "") == "relax.permute_dims" and \
            isinstance(w.args[0].ty, relax.TensorType):
        rank, axes = w.args[0].ty.ndim, w.attrs.axes
        swapped = list(range(rank - 2)) + [rank - 1, rank - 2]
        if (axes is None and rank == 2) or (axes is not None and [int(a) for a in axes] == swapped):
            return w.args[0], True
    return w, False


def _is_activation_product(x: relax.Expr, w: relax.Expr) -> bool:
    """Both operands batches of matrices (rank 3 or more): attention's products."""
    return all(isinstance(e.ty, relax.TensorType) and e.ty.ndim >= 3 for e in (x, w))


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


def _rewrite_batched(root, x: relax.Expr, w: relax.Expr) -> relax.Expr:
    """``matmul(x, w)`` of two activations with the same batch dims ([..., M, K] by
    [..., K, N], ``w`` maybe ``permute_dims`` of [..., N, K]): one strided-batched call."""
    stored, transposed = _stored(w)
    x_ty, w_ty, out_ty = x.ty, stored.ty, root.ty
    if not all(isinstance(t, relax.TensorType) and t.shape is not None and t.ndim >= 3
               for t in (x_ty, w_ty, out_ty)):
        return root
    dtype = str(out_ty.dtype)
    if dtype not in LIBRARY_DTYPES or str(x_ty.dtype) != dtype or str(w_ty.dtype) != dtype:
        return root
    xs, ws = x_ty.shape.values, w_ty.shape.values
    k_of_w = ws[-1] if transposed else ws[-2]
    if x_ty.ndim != w_ty.ndim or not same_dims(xs[:-2], ws[:-2]) or \
            not same_dims([xs[-1]], [k_of_w]):
        return root  # broadcast batch dims, or K not provably equal: TVM's kernel
    function = MatmulFunction("", transposed, batched=True)
    return relax.op.call_dps_packed(function.name, relax.Tuple([x, stored]),
                                    relax.TensorType(out_ty.shape, dtype))


def _rewrite(root, matched: dict, root_pattern) -> relax.Expr:
    match = _Match(matched, root_pattern)
    x_ty, out_ty = match.x.ty, root.ty
    dtype = str(out_ty.dtype)
    if root_pattern is _MATMUL and _is_activation_product(match.x, match.w):
        return _rewrite_batched(root, match.x, match.w)
    if dtype not in LIBRARY_DTYPES or str(x_ty.dtype) != dtype:
        return root
    stored, transposed = _stored(match.w)
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

    A product of two batches of matrices with the same batch dims (attention's scores,
    ``q @ permute_dims(k)``, and its weighted sum, ``p @ v``) becomes one strided-batched
    call (``grape.cublaslt.batched_matmul[_nt]``). Matmuls of other dtypes, whose out dtype
    differs from their inputs', or whose batch dims broadcast, stay TVM's.

    Before::

        lv = R.matmul(x, w)                  # x: (n, 768), w: (768, 3072)
        lv1 = R.add(lv, b)                   # b: (3072,)
        y = R.nn.gelu_tanh(lv1)

    After::

        y = R.call_dps_packed("grape.cublaslt.matmul_bias_gelu", (x, w, b),
                              out_ty=R.Tensor((n, 3072), "float32"))

    and ``s = R.matmul(q, R.permute_dims(k, [0, 1, 3, 2]))`` with q: (b, 12, 1, 64), k:
    (b, 12, p, 64) becomes ``R.call_dps_packed("grape.cublaslt.batched_matmul_nt", (q, k),
    out_ty=R.Tensor((b, 12, 1, p), "float32"))``.
    """

    def transform_function(self, func: relax.Function, mod: IRModule,
                           ctx: PassContext) -> relax.Function:
        for pattern in PATTERNS:
            func = rewrite_call(pattern, lambda root, matched, p=pattern: _rewrite(root, matched, p),
                                func)
        return func
