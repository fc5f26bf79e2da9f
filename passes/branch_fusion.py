"""Operator fusion inside the branches of an ``if``.

TVM's ``FuseOps`` fuses within the dataflow blocks of a function's body and does not look
inside the branches of an ``if``: every operator of a branch becomes a kernel of its own.
``OutlineBranches`` moves each branch into a private function of its own, where fusion
works as anywhere else; ``InlineBranches`` puts the fused branches back.
"""

from __future__ import annotations

from tvm import IRModule, relax
from tvm.ir.transform import PassContext, module_pass

from .lift_regions import seq_bindings

BRANCH_FUNC_ATTR = "grape.branch_body"


def _is_branch_func(func) -> bool:
    return isinstance(func, relax.Function) and func.attrs is not None and \
        BRANCH_FUNC_ATTR in func.attrs


def _outlinable(seq: relax.Expr) -> bool:
    """A branch of pure bindings (nested ``if``s included, outlined in their own function's
    turn): the outlined function is pure, and fusing it cannot reorder a side effect."""
    if not isinstance(seq, relax.SeqExpr) or not seq.blocks:
        return False
    return not any(relax.analysis.contains_impure_call(b.value) for b in seq_bindings(seq))


@relax.expr_functor.mutator
class _Outliner(relax.PyExprMutator):
    """Outlines the branches of the ``if``s of one function into new private functions."""

    def __init__(self, mod: IRModule, prefix: str):
        super().__init__(mod)
        self.prefix = prefix
        self.count = 0

    def visit_if_(self, op: relax.If) -> relax.Expr:
        return relax.If(op.cond, self._outline(op.true_branch, "then"),
                        self._outline(op.false_branch, "else"))

    def _outline(self, seq: relax.Expr, side: str) -> relax.Expr:
        if not _outlinable(seq):
            return self.visit_expr(seq)
        params = [v for v in relax.analysis.free_vars(seq)]
        args = list(params)
        # Dims the parameters' shapes use but do not define (only in an expression, as
        # n * m // 16): passed as a shape, else inlining back cannot map them to the caller's.
        dims = relax.analysis.free_symbolic_vars(relax.Function(params, seq, seq.body.ty))
        if dims:
            params.append(relax.Var("dims", relax.ShapeType(list(dims))))
            args.append(relax.ShapeExpr(list(dims)))
        func = relax.Function(params, seq, seq.body.ty, is_pure=True)
        func = relax.utils.copy_with_new_vars(func).with_attr(BRANCH_FUNC_ATTR, side)
        gvar = self.builder_.add_func(func, f"{self.prefix}_{side}{self.count}")
        self.count += 1
        result = relax.Var(f"{side}_result", seq.body.ty)
        call = relax.VarBinding(result, relax.Call(gvar, args))
        return relax.SeqExpr([relax.BindingBlock([call])], result)


@module_pass(opt_level=0, name="OutlineBranches")
class OutlineBranches:
    """Move each branch of an ``if`` into a private function, so that ``FuseOps`` fuses it.

    Before (``FuseOps`` leaves three kernels)::

        if c:
            with R.dataflow():
                a = R.matmul(h, w)
                t = R.nn.gelu(a)
                R.output(t)
            r = t
        else: ...

    After (``fused_matmul_gelu`` once fused)::

        if c:
            r = main_branch_then0(h, w)
        else: ...

        @R.function(private=True)
        def main_branch_then0(h, w):
            R.func_attr({"grape.branch_body": "then"})
            with R.dataflow(): ...
            return t

    A nested ``if`` goes with its branch and is outlined in turn; branches with an impure
    call stay. Dims the branch uses that no parameter's shape defines (a tensor of shape
    ``(n * m // 16, 16)`` defines neither ``n`` nor ``m``) are passed as one more
    parameter, a shape (``dims: R.Shape([n, m])``). The outlined bodies get dataflow blocks (``ConvertToDataflow``, any size).
    ``InlineBranches`` undoes the outlining after fusion.
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        pending = [gv for gv, f in mod.functions.items() if isinstance(f, relax.Function)]
        while pending:
            gvar = pending.pop()
            outliner = _Outliner(mod, f"{gvar.name_hint}_branch")
            func = outliner.visit_expr(mod[gvar])
            if outliner.count == 0:
                continue
            outliner.builder_.update_func(gvar, func)
            mod = outliner.builder_.get()
            # The new functions may hold nested ifs: look at them too.
            pending += [gv for gv, f in mod.functions.items()
                        if _is_branch_func(f) and gv.name_hint.startswith(outliner.prefix)]
        # Dataflow blocks of every size: a one-operator branch step fuses with its neighbours.
        return relax.transform.ConvertToDataflow(min_size=1)(mod)


@module_pass(opt_level=0, name="InlineBranches")
class InlineBranches:
    """Put outlined branches (``OutlineBranches``) back into their ``if``s, after fusion.

    A branch ``r = main_branch_then0(h, w)`` becomes the function's body with ``h`` and
    ``w`` for its parameters (and the caller's symbolic dims for its own, inferred from
    the arguments' shapes); the private functions go.
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        branch_funcs = {gv for gv, f in mod.functions.items() if _is_branch_func(f)}
        if not branch_funcs:
            return mod
        out = IRModule({gv: f for gv, f in mod.functions.items() if gv not in branch_funcs},
                       attrs=mod.attrs)
        for gvar, func in list(out.functions.items()):
            if isinstance(func, relax.Function):
                out[gvar] = _Inliner(mod).visit_expr(func)
        return relax.transform.Normalize()(out)


@relax.expr_functor.mutator
class _Inliner(relax.PyExprMutator):
    """Binds the outlined branches of one function's ``if``s back into them."""

    def __init__(self, mod: IRModule):
        super().__init__()
        self.mod = mod

    def visit_if_(self, op: relax.If) -> relax.Expr:
        return relax.If(op.cond, self._inline(op.true_branch), self._inline(op.false_branch))

    def _inline(self, seq: relax.Expr) -> relax.Expr:
        bindings = seq_bindings(seq) if isinstance(seq, relax.SeqExpr) else []
        if len(bindings) != 1 or not isinstance(bindings[0].value, relax.Call) or \
                not isinstance(bindings[0].value.op, relax.GlobalVar) or \
                not _is_branch_func(self.mod[bindings[0].value.op]):
            return self.visit_expr(seq)
        call = bindings[0].value
        func = self.mod[call.op]
        body = func.bind_params(dict(zip(func.params, call.args))).body
        body = self.visit_expr(body)  # its own nested branches
        return relax.SeqExpr(list(body.blocks), body.body)
