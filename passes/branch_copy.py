"""A branch that returns a value from outside it gets a copy, so that it writes its result."""

from __future__ import annotations

from tvm import IRModule, relax
from tvm.ir.transform import PassContext
from tvm.relax.transform import function_pass


def _defined(seq: relax.SeqExpr) -> set:
    return {b.var for block in seq.blocks for b in block.bindings}


@relax.expr_functor.mutator
class _CopyResults(relax.PyExprMutator):
    def __init__(self):
        super().__init__()
        self.copies = 0

    def visit_if_(self, op: relax.If) -> relax.Expr:
        op = super().visit_if_(op)
        return relax.If(op.cond, self._copied(op.true_branch), self._copied(op.false_branch))

    def _copied(self, seq: relax.Expr) -> relax.Expr:
        if not isinstance(seq, relax.SeqExpr):
            return seq
        result = seq.body
        ty = result.ty
        if not isinstance(result, relax.Var) or result in _defined(seq) or \
                not isinstance(ty, relax.TensorType) or ty.dtype is None:
            return seq
        self.copies += 1
        copy = relax.Var(f"{result.name}_copy", ty)
        binding = relax.VarBinding(copy, relax.op.astype(result, ty.dtype))
        return relax.SeqExpr(list(seq.blocks) + [relax.BindingBlock([binding])], copy)


@function_pass(opt_level=0, name="CopyPassThroughBranches")
class CopyPassThroughBranches:
    """A branch whose result is a tensor from outside it (an input, an earlier value) copies
    it: every branch then writes its result into a buffer of its own, which
    ``BranchesToConditionalRegions`` needs to turn the ``if`` into a conditional region
    (else it stays on the host). The copy is a cast to the same dtype: one kernel, run only
    when that branch is taken. Cheap branches have become selects before this
    (``IfToSelect``), where a pass-through costs nothing.

    Before::

        if c:
            r = R.nn.relu(R.matmul(h, w))   # ... and more
        else:
            r = h

    After::

        if c:
            r = R.nn.relu(R.matmul(h, w))
        else:
            h_copy = R.astype(h, "float32")
            r = h_copy
    """

    def transform_function(self, func: relax.Function, mod: IRModule,
                           ctx: PassContext) -> relax.Function:
        mutator = _CopyResults()
        new = mutator.visit_expr(func)
        return new if mutator.copies else func
