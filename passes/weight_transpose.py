"""Weights in the layout grape's matmul kernels read: a transposed 2-D weight read where it
lies (no transpose kernel), and a weight stored [K, N] stored [N, K]."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tvm import IRModule, relax, te, tirx
from tvm.ir import GenericConst, Op
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


# On ``main``: the positions of the parameters ``StoreWeightsTransposed`` took transposed
# ([N, K] for a weight the model declares [K, N]); ``build`` names them in the plan, the
# executor transposes each once when it is bound.
TRANSPOSED_INPUTS_ATTR = "grape.transposed_inputs"


def _float_matrix(ty) -> bool:
    return isinstance(ty, relax.TensorType) and ty.ndim == 2 and ty.shape is not None and \
        all(isinstance(d, tirx.IntImm) for d in ty.shape.values) and \
        str(ty.dtype).startswith(("float", "bfloat"))


def _read_by_matmuls_alone(functions) -> set:
    """The constants and variables of ``functions`` that matmuls read as their weight (B)
    and nothing else reads (as ``var_reads.read_counts`` counts reads: a parameter's
    definition is not one)."""
    reads: dict = {}
    as_weight: dict = {}

    def visit(node):
        if isinstance(node, (relax.Var, GenericConst)):
            reads[node] = reads.get(node, 0) + 1
        elif isinstance(node, relax.Call) and node.op == _MATMUL and \
                _float_matrix(node.args[1].ty):
            as_weight[node.args[1]] = as_weight.get(node.args[1], 0) + 1

    for func in functions:
        relax.analysis.post_order_visit(func, visit)
    return {w for w, n in as_weight.items() if reads.get(w) == n}


@relax.expr_functor.mutator
class _StoreTransposed(relax.PyExprMutator):
    def __init__(self, mod: IRModule, stored: dict):
        super().__init__(mod)
        # a weight (constant or parameter) -> what holds it [N, K]: a constant, made once,
        # or the parameter that replaces it
        self.stored = stored

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        if call.op != _MATMUL or call.args[1] not in self.stored:
            return super().visit_call_(call)
        x = self.visit_expr(call.args[0])
        wt = self.builder_.emit(relax.op.permute_dims(self.stored[call.args[1]]))
        return relax.op.matmul(x, wt, out_dtype=call.attrs.out_dtype)


def _transposed_param(param: relax.Var) -> relax.Var:
    rows, cols = param.ty.shape.values
    return relax.Var(param.name, relax.TensorType((cols, rows), param.ty.dtype))


@module_pass(opt_level=0, name="StoreWeightsTransposed")
class StoreWeightsTransposed:
    """A 2-D weight of ``matmul(x, w)`` stored [K, N] (HF GPT-2's Conv1D, ONNX ``MatMul`` by
    an initializer) is stored transposed, [N, K], and read through ``permute_dims``: the
    layout of ``nn.Linear``, whose rows are the output's columns. ``OffloadMatmul`` then
    calls the library's ``_nt`` function and ``GemvForFewRows`` gives it grape's "nk" GEMV
    kernels up to 8 rows, where the [K, N] layout has one. On the H200
    (bench/results/matmul.json, GPT-2's five weight shapes, the default matmul in grape's
    graphs) a weight stored [N, K] takes 0.74x to 0.90x the time of one stored [K, N] at
    M = 1 in fp32 and 0.69x to 0.85x in fp16; at M = 8, 0.42x to 0.58x in fp32 and 0.44x to
    1.19x in fp16.

    Which weights: every constant (copied once, here; ``constants=False`` leaves them), and
    the parameters of ``main`` at the positions ``inputs``, weights the caller binds once
    (``GraphExecutor.bind_inputs`` transposes each as it binds it; ``main``'s
    ``grape.transposed_inputs`` lists their positions). A weight read by anything but
    matmuls keeps its layout: no second copy of it.

    Before::

        def main(x: R.Tensor((m, 768)), w: R.Tensor((768, 3072))):   # inputs=[1]
            y = R.matmul(x, w)
            z = R.matmul(x, metadata["relax.expr.Constant"][0])      # (768, 3072)

    After::

        def main(x: R.Tensor((m, 768)), w: R.Tensor((3072, 768))):   # transposed_inputs [1]
            wt = R.permute_dims(w)
            y = R.matmul(x, wt)
            ct = R.permute_dims(metadata["relax.expr.Constant"][1])  # (3072, 768) in memory
            z = R.matmul(x, ct)
    """

    def __init__(self, inputs: Sequence[int] = (), constants: bool = True):
        self.inputs = frozenset(inputs)  # positions of main's parameters
        self.constants = constants

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        functions = [(g, f) for g, f in mod.functions_items() if isinstance(f, relax.Function)]
        alone = _read_by_matmuls_alone(f for _, f in functions)
        stored = {w: relax.const(np.ascontiguousarray(w.value.numpy().T))
                  for w in alone if isinstance(w, GenericConst)} if self.constants else {}
        main = next((f for g, f in functions if g.name_hint == "main"), None)
        params = {p: _transposed_param(p) for i, p in enumerate(main.params)
                  if i in self.inputs and p in alone} if main is not None else {}
        if not stored and not params:
            return mod
        store = _StoreTransposed(mod, {**stored, **params})
        for gvar, func in functions:
            new = store.visit_expr(func)
            if func is main and params:
                new = relax.Function([params.get(p, p) for p in func.params], new.body,
                                     new.ret_ty, new.is_pure, new.attrs, new.span)
                new = new.with_attr(TRANSPOSED_INPUTS_ATTR,
                                    [i for i, p in enumerate(func.params) if p in params])
            store.builder_.update_func(gvar, new)
        return store.builder_.get()
