"""A matmul by a transposed 2-D weight reads the weight where it lies: no transpose kernel."""

from __future__ import annotations

from tvm import IRModule, relax, te
from tvm.ir import Op
from tvm.ir.transform import PassContext, module_pass

_MATMUL = Op.get("relax.matmul")
_PERMUTE = Op.get("relax.permute_dims")


def _transposed_matrix(expr: relax.Expr) -> relax.Expr | None:
    """``w`` when ``expr`` is ``permute_dims(w)`` of a 2-D ``w`` (axes None or [1, 0])."""
    if not isinstance(expr, relax.Call) or expr.op != _PERMUTE:
        return None
    (w,) = expr.args
    ty = w.ty
    if not isinstance(ty, relax.TensorType) or ty.ndim != 2:
        return None
    axes = expr.attrs.axes
    return w if axes is None or [int(a) for a in axes] == [1, 0] else None


def _nt_matmul(x: te.Tensor, w: te.Tensor, dtype: str) -> te.Tensor:
    """``y[.., n] = sum_k x[.., k] * w[n, k]``."""
    k = te.reduce_axis((0, x.shape[-1]), name="k")

    def element(*index):
        return te.sum(x(*index[:-1], k).astype(dtype) * w(index[-1], k).astype(dtype), axis=k)

    return te.compute((*x.shape[:-1], w.shape[0]), element, name="NT_matmul")


@relax.expr_functor.mutator
class _Fuse(relax.PyExprMutator):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.fused = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if call.op != _MATMUL or not isinstance(call.args[1], relax.Var):
            return call
        x = call.args[0]
        w = _transposed_matrix(self.lookup_binding(call.args[1]))
        if w is None or not isinstance(x.ty, relax.TensorType) or x.ty.ndim < 1:
            return call
        self.fused += 1
        return self.builder_.call_te(_nt_matmul, x, w, str(call.ty.dtype),
                                     primfunc_name_hint="NT_matmul")


@module_pass(opt_level=0, name="FuseWeightTranspose")
class FuseWeightTranspose:
    """``matmul(x, permute_dims(w))`` with a 2-D ``w`` (``nn.Linear``'s weight, ONNX ``Gemm``
    with ``transB``) becomes one TIR function reading ``w[n, k]``: no kernel copies the
    weight on every call, and the matmul kernel (``DecodeGemv``'s "nk" layout, or dlight's)
    sees the weight as it lies. Transposes of other ranks (attention's ``k``) stay.

    Before::

        wt = R.permute_dims(w)          # (K, N): a copy of the weight, every call
        y = R.matmul(x, wt)

    After::

        y = R.call_tir(NT_matmul, (x, w), R.Tensor((m, N)))   # y[i, n] = sum_k x[i, k] w[n, k]
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        fuse = _Fuse(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                new = fuse.visit_expr(func)
                fuse.builder_.update_func(gvar, relax.analysis.remove_all_unused(new))
        return fuse.builder_.get() if fuse.fused else mod
