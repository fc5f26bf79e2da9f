"""Matmuls with a weight of static shape become calls of cuBLASLt, through grape's runtime."""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import relax, tirx
from tvm.ir import IRModule
from tvm.ir.transform import PassContext
from tvm.relax.dpl import WildcardPattern, is_const, is_op, rewrite_call, wildcard
from tvm.relax.transform import function_pass

from grape_tvm.runtime.cublaslt import EPILOGUES, MatmulFunction

from .if_to_select import same_dims
from .var_reads import read_counts

LIBRARY_DTYPES = ("float32", "float16", "bfloat16")
# Activations cuBLASLt's epilogue computes as the model does. ReLU is not one of them:
# cuBLASLt's turns NaN into 0, grape's ReLU keeps it, as onnxruntime does (passes/numerics.py).
_ACTIVATIONS = {"relax.nn.gelu_tanh": "gelu"}


def static_dims(ty) -> list[int] | None:
    """The dims of a tensor type when all are static, else None."""
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
    """What a matched pattern binds: x, the weight, the bias, the residual and the reshape's
    shape if any, and the activation (by op or as its formula, ``_Pattern``)."""

    def __init__(self, matched: dict, pattern: "_Pattern", root):
        self.x = matched[_X]
        self.w = matched[_W]
        self.bias = matched.get(_B)
        self.residual = matched.get(_R)
        self.product = matched[pattern.product]  # the matmul's value, before any reshape
        self.activation = pattern.activation
        if isinstance(root, relax.Call) and root.op.name in _ACTIVATIONS:
            self.activation = _ACTIVATIONS[root.op.name]
        self.constants_hold = all(_near(matched[c], v) for c, v in _GELU_CONSTANTS.items()
                                  if c in matched)


# How far a half-precision constant may be from the value it stands for, relative to it:
# twice its rounding (2^-11 and 2^-8).
_HALF_TOLERANCE = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def _near(expr: relax.Expr, value: float) -> bool:
    """A scalar constant of ``value`` to its dtype's precision: an fp16 export's
    sqrt(2 / pi) is 0.79785, 4e-5 from the value."""
    if not isinstance(expr, tvm.ir.GenericConst) or expr.value.numpy().size != 1:
        return False
    got = float(expr.value.numpy().reshape(()))
    half = _HALF_TOLERANCE.get(str(expr.value.dtype))
    if half is not None:
        return abs(got - value) <= half * abs(value)
    return abs(got - value) <= 1e-6 * max(1.0, abs(value))  # float32 printed to 8 digits


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


class _Uses:
    """How often each variable of a function is read, and the variable each value is bound
    to: a fused epilogue must not take a value that something else also reads (the matmul
    would then run twice, once for the call and once for the other reader)."""

    def __init__(self, func: relax.Function):
        self.count = read_counts(func.body)
        # every binding of the function, those inside an ``if``'s branches too
        self.var_of: dict[relax.Expr, relax.Var] = {
            value: var for var, value in relax.analysis.get_var2val(func).items()}

    def read_outside(self, root: relax.Expr, matched: dict) -> bool:
        """Whether a value inside the match (neither its root nor one of its inputs) is
        also read by something the match does not hold."""
        inside = [v for k, v in matched.items()
                  if isinstance(v, relax.Call) and not isinstance(k, WildcardPattern)]
        reads: dict[relax.Var, int] = {}
        for call in set(inside + [root]):  # TVM objects hash and compare by identity
            for arg in call.args:
                if isinstance(arg, relax.Var):
                    reads[arg] = reads.get(arg, 0) + 1
        for value in inside:
            var = self.var_of.get(value)
            if var is not None and not value.same_as(root) and \
                    self.count.get(var, 0) > reads.get(var, 0):
                return True
        return False


def _rewrite(root, matched: dict, pattern: "_Pattern", uses: _Uses) -> relax.Expr:
    if uses.read_outside(root, matched):
        return root
    match = _Match(matched, pattern, root)
    if pattern.plain and _is_activation_product(match.x, match.w):
        return _rewrite_batched(root, match.x, match.w)
    if not match.constants_hold:
        return root
    product_ty, out_ty = match.product.ty, root.ty
    x_ty, dtype = match.x.ty, str(out_ty.dtype)
    if dtype not in LIBRARY_DTYPES or str(x_ty.dtype) != dtype or \
            str(product_ty.dtype) != dtype:
        return root
    stored, transposed = _stored(match.w)
    w_dims = static_dims(stored.ty)
    if w_dims is None or len(w_dims) != 2 or str(stored.ty.dtype) != dtype:
        return root
    n, k = w_dims if transposed else w_dims[::-1]
    if x_ty.ndim < 2 or not isinstance(x_ty.shape.values[-1], tirx.IntImm) or \
            int(x_ty.shape.values[-1]) != k:
        return root
    args, epilogue, residual = [match.x, stored], "", False
    if match.bias is not None:
        if static_dims(match.bias.ty) == [n] and str(match.bias.ty.dtype) == dtype:
            args.append(match.bias)
            epilogue = "bias"
        elif pattern.residual_or_bias and _same_shape(match.bias.ty, product_ty):
            args.append(match.bias)  # matmul(x, w) + r, r of the product's shape
            residual = True
        else:
            return root
    if match.residual is not None:
        if not _same_shape(match.residual.ty, out_ty) or str(match.residual.ty.dtype) != dtype:
            return root
        # Added in the product's shape: a reshape of a dense tensor is a view.
        args.append(relax.op.reshape(match.residual, product_ty.shape)
                    if not _same_shape(out_ty, product_ty) else match.residual)
        residual = True
    if match.activation:
        epilogue = f"{epilogue}_{match.activation}" if epilogue else match.activation
    assert epilogue in EPILOGUES
    function = MatmulFunction(epilogue, transposed, residual=residual)
    call = relax.op.call_dps_packed(function.name, relax.Tuple(args),
                                    relax.TensorType(product_ty.shape, dtype))
    return call if _same_shape(out_ty, product_ty) else relax.op.reshape(call, out_ty.shape)


def _same_shape(a, b) -> bool:
    return isinstance(a, relax.TensorType) and isinstance(b, relax.TensorType) and \
        a.shape is not None and b.shape is not None and \
        same_dims(a.shape.values, b.shape.values)


def _commutative(op: str, a, b):
    return is_op(op)(a, b) | is_op(op)(b, a)


_X, _W, _B, _R, _S = wildcard(), wildcard(), wildcard(), wildcard(), wildcard()
_C05, _C3, _C044, _C079, _C1 = (is_const() for _ in range(5))
# tanh-GELU as exporters write it: 0.5 * v * (1 + tanh(sqrt(2 / pi) * (v + 0.044715 * v^3)))
_GELU_CONSTANTS = {_C05: 0.5, _C3: 3.0, _C044: 0.044715, _C079: math.sqrt(2 / math.pi),
                   _C1: 1.0}


def _tanh_gelu(v):
    cubed = _commutative("relax.multiply", is_op("relax.power")(v, _C3), _C044)
    inner = _commutative("relax.multiply", _commutative("relax.add", v, cubed), _C079)
    one_plus = _commutative("relax.add", is_op("relax.tanh")(inner), _C1)
    return _commutative("relax.multiply", _commutative("relax.multiply", v, _C05), one_plus)


@dataclass(frozen=True, eq=False)
class _Pattern:
    """A pattern and what it means: ``product`` is its node of the matmul's value (the
    reshape's input where there is one); ``activation`` one written as its formula;
    ``residual_or_bias``: the added tensor may be either (told apart by its shape);
    ``plain``: a matmul alone, which may also be a product of two activations."""

    pattern: object
    product: object
    activation: str | None = None
    residual_or_bias: bool = False
    plain: bool = False


def _patterns() -> list[_Pattern]:
    """Largest first: an epilogue is fused only where the whole chain matches."""
    matmul = is_op("relax.matmul")(_X, _W)
    biased = _commutative("relax.add", matmul, _B)
    found = []
    for product in (biased, matmul):
        for value in (is_op("relax.reshape")(product, _S), product):
            found.append(_Pattern(_tanh_gelu(value), product, activation="gelu"))
            found += [_Pattern(is_op(op)(value), product) for op in _ACTIVATIONS]
    for value, product in ((is_op("relax.reshape")(biased, _S), biased), (biased, biased),
                           (is_op("relax.reshape")(matmul, _S), matmul)):
        found.append(_Pattern(_commutative("relax.add", value, _R), product))
    found.append(_Pattern(biased, biased, residual_or_bias=True))
    found.append(_Pattern(matmul, matmul, plain=True))
    return found


PATTERNS = _patterns()


@function_pass(opt_level=0, name="OffloadMatmul")
class OffloadMatmul:
    """Rewrite ``matmul(x, w)`` (w a 2-D weight of static shape, stored [K, N] or used
    transposed from [N, K]; x of any rank, its rows symbolic), with a bias add and a
    tanh-GELU after it where present, or a bias and a residual (a tensor of the output's
    shape, added as cuBLASLt's C), into one call of a cuBLASLt function of grape's runtime
    (``runtime/cublaslt.py``: the function's name says its epilogue). A reshape between the
    matmul and the rest (ONNX exports of 3-D activations) is kept after the call; a GELU
    written out as its tanh formula is recognized (its constants checked). The call is a
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

    and ``y = R.add(r, R.reshape(R.add(R.matmul(h, w2), b2), R.shape([m, 1, 768])))`` with
    h: (m, 3072) becomes ``R.reshape(R.call_dps_packed("grape.cublaslt.matmul_bias_residual",
    (h, w2, b2, R.reshape(r, R.shape([m, 768]))), ...), R.shape([m, 1, 768]))``.

    and ``s = R.matmul(q, R.permute_dims(k, [0, 1, 3, 2]))`` with q: (b, 12, 1, 64), k:
    (b, 12, p, 64) becomes ``R.call_dps_packed("grape.cublaslt.batched_matmul_nt", (q, k),
    out_ty=R.Tensor((b, 12, 1, p), "float32"))``.
    """

    def transform_function(self, func: relax.Function, mod: IRModule,
                           ctx: PassContext) -> relax.Function:
        uses, counted = None, None
        for pattern in PATTERNS:
            if counted is None or not func.same_as(counted):  # a pattern rewrote something
                uses, counted = _Uses(func), func
            func = rewrite_call(pattern.pattern,
                                lambda root, matched, p=pattern, u=uses: _rewrite(root, matched,
                                                                                  p, u),
                                func)
        return func
