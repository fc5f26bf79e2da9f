"""A fused function's integer scalar parameters passed as dims, for TVM's ``FuseTIR``."""

from __future__ import annotations

import tvm
from tvm import IRModule, relax, tirx
from tvm.ir.transform import PassContext, module_pass


def _is_int_scalar(param: relax.Var) -> bool:
    return isinstance(param.ty, tvm.ir.PrimType) and "int" in str(param.ty.dtype)


def _fusable(func) -> bool:
    """A fused (``Primitive``) function taking both an integer scalar and a shape: the
    combination ``FuseTIR`` fails on."""
    if not isinstance(func, relax.Function) or func.attrs is None or \
            "Primitive" not in func.attrs:
        return False
    params = list(func.params)
    return bool(params) and isinstance(params[-1].ty, relax.ShapeType) and \
        params[-1].ty.values is not None and any(_is_int_scalar(p) for p in params)


def _callers(mod: IRModule, gvar: relax.GlobalVar) -> list[relax.Call]:
    calls = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(gvar):
            calls.append(expr)

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    return calls


def _scalar_dim(arg) -> tirx.Var | None:
    """The dim a scalar argument passes: ``R.prim_value(n)`` of a shape variable."""
    if isinstance(arg, tirx.Var) and isinstance(arg.ty, tvm.ir.PrimType) and \
            str(arg.ty.dtype) == "int64":
        return arg
    return None


@relax.expr_functor.mutator
class _Calls(relax.PyExprMutator):
    """Calls of the rewritten functions: to their new version, the scalar arguments moved
    into the shape argument."""

    def __init__(self, mod: IRModule, moved: dict):
        super().__init__(mod)
        self.moved = moved  # old global var -> (new global var, indices of the scalars)

    def visit_call_(self, op: relax.Call) -> relax.Expr:
        call = super().visit_call_(op)
        if not isinstance(call.op, relax.GlobalVar) or call.op not in self.moved:
            return call
        gvar, indices = self.moved[call.op]
        args = list(call.args)
        dims = [_scalar_dim(args[i]) for i in indices]
        kept = [a for i, a in enumerate(args[:-1]) if i not in indices]
        shape = relax.ShapeExpr(list(args[-1].values) + dims)
        return relax.Call(gvar, kept + [shape], call.attrs, call.ty_args)


@module_pass(opt_level=0, name="FusedScalarsAsDims")
class FusedScalarsAsDims:
    """A fused function's integer scalar parameter, which every call passes a dim to
    (``R.prim_value(past)``), becomes a dim of its shape parameter (``tir_vars``).

    ``FuseOps`` passes a dim an operator reads as a scalar (``R.add(x, R.prim_value(past))``,
    ``x + past``) as a scalar parameter, and the dims that only an output's shape has (no
    input tensor's) as a trailing shape parameter. TVM 0.27's ``FuseTIR`` fails on a
    function with both ("Check failed: (VarRemapGet(source) == nullptr)", in
    ``RenewDefs``): Whisper's decode step has ``arange(1) + past`` tiled to ``[batch, 1]``
    in one fused kernel. A dim passed in the shape parameter, read by the operator as
    ``R.prim_value(past)``, fuses: it is the form ``FuseOps`` gives when an output's shape
    has the dim too.

    Before::

        def fused_add_tile(x: R.Tensor((1,), "int64"), past: R.Prim("int64"),
                           tir_vars: R.Shape([batch])) -> R.Tensor((batch, 1), "int64"):
            lv = R.call_tir(cls.add, (x, past), ...)
        ... cls.fused_add_tile(x, R.prim_value(past), R.shape([batch]))

    After::

        def fused_add_tile(x: R.Tensor((1,), "int64"),
                           tir_vars: R.Shape([batch, past])) -> R.Tensor((batch, 1), "int64"):
            lv = R.call_tir(cls.add, (x, R.prim_value(past)), ...)
        ... cls.fused_add_tile(x, R.shape([batch, past]))

    Only functions with both (every other module is returned unchanged), and only when every
    call passes each such scalar a dim and the shape parameter a literal shape.
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        rewritten = {}
        for gvar, func in mod.functions_items():
            if not _fusable(func):
                continue
            indices = [i for i, p in enumerate(func.params) if _is_int_scalar(p)]
            calls = _callers(mod, gvar)
            if not calls or any(
                    not isinstance(c.args[-1], relax.ShapeExpr) or
                    any(_scalar_dim(c.args[i]) is None for i in indices) for c in calls):
                continue
            fresh = {func.params[i]: tirx.Var(func.params[i].name, "int64") for i in indices}
            bound = func.bind_params(dict(fresh))
            shape_param = bound.params[-1]
            dims = relax.Var(shape_param.name,
                             relax.ShapeType(list(shape_param.ty.values) + list(fresh.values())))
            rewritten[gvar] = (indices, relax.Function(
                list(bound.params[:-1]) + [dims], bound.body, bound.ret_ty, bound.is_pure,
                bound.attrs))
        if not rewritten:
            return mod
        mutator = _Calls(mod, {})
        for gvar, (indices, func) in rewritten.items():
            mutator.moved[gvar] = (mutator.builder_.add_func(func, gvar.name_hint), indices)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function) and gvar not in rewritten:
                mutator.builder_.update_func(gvar, mutator.visit_expr(func))
        out = mutator.builder_.get()
        return IRModule({g: f for g, f in out.functions_items() if g not in rewritten},
                        out.attrs, out.global_infos)


def before_fuse_tir(passes) -> list:
    """``passes`` with ``FusedScalarsAsDims`` before each ``FuseTIR``: where every grape
    pipeline (CPU and GPU) needs it."""
    out = []
    for p in passes:
        if p.info.name == "FuseTIR":
            out.append(FusedScalarsAsDims())
        out.append(p)
    return out
