"""Cheap, side-effect-free branches on a tensor condition become element-wise selects."""

from __future__ import annotations

from tvm import IRModule, relax
from tvm.ir import Op
from tvm.ir.transform import PassContext
from tvm.relax.transform import function_pass
from tvm.sym.analyzer import Analyzer

# Ops that could trap on the branch not taken (integer division by zero): never hoisted.
_TRAPPING_OPS = {"relax.divide", "relax.floor_divide", "relax.mod", "relax.floor_mod"}
# Ops that read or write at indices taken from data: the if may be what keeps the indices
# in bounds (``if i < n: take(x, i)``), so the branch not taken would read out of bounds
# (TVM lowers take without a check): never hoisted.
_INDEXING_OPS = {"relax.take", "relax.gather_elements", "relax.gather_nd",
                 "relax.dynamic_strided_slice", "relax.scatter_elements", "relax.scatter_nd",
                 "relax.index_put", "relax.index_tensor"}
NOTES_ATTR = "grape.if_notes"  # on a function: if var -> why its cheap branches are no select


def _branch_bindings(branch: relax.Expr) -> list[relax.Binding] | None:
    if not isinstance(branch, relax.SeqExpr):
        return None
    return [b for block in branch.blocks for b in block.bindings]


def _hoistable(bindings: list[relax.Binding], max_ops: int) -> bool:
    """Plain bindings of pure relax ops (or variables), at most ``max_ops`` ops, none that
    could trap on integers or index with data."""
    ops = 0
    for binding in bindings:
        if not isinstance(binding, relax.VarBinding):
            return False
        value = binding.value
        if isinstance(value, relax.Var):
            continue
        if not isinstance(value, relax.Call) or not isinstance(value.op, Op):
            return False
        name = value.op.name
        if not name.startswith("relax.") or name.startswith(("relax.call_", "relax.memory.",
                                                             "relax.builtin.", "relax.vm.")):
            return False
        if name in _TRAPPING_OPS and "int" in str(binding.var.ty.dtype):
            return False
        if name in _INDEXING_OPS:
            return False
        if relax.analysis.contains_impure_call(value):
            return False
        ops += 1
    return ops <= max_ops


def _cheap(binding: relax.Binding, max_ops: int) -> bool:
    """An ``if`` on a 0-d bool tensor whose result is a tensor and whose branches are
    hoistable (see ``IfToSelect``); shapes not looked at."""
    value = binding.value
    if not isinstance(value, relax.If) or not isinstance(binding, relax.VarBinding):
        return False
    cond_ty = value.cond.ty
    result_ty = binding.var.ty
    if not (isinstance(cond_ty, relax.TensorType) and cond_ty.ndim == 0
            and str(cond_ty.dtype) == "bool" and isinstance(result_ty, relax.TensorType)):
        return False
    branches = [_branch_bindings(value.true_branch), _branch_bindings(value.false_branch)]
    return all(b is not None and _hoistable(b, max_ops) for b in branches)


def _dims(ty) -> list | None:
    if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
        return list(ty.shape.values)
    return None


def same_dims(a: list, b: list, analyzer: Analyzer | None = None) -> bool:
    """Two shapes provably equal, dim by dim."""
    analyzer = analyzer or Analyzer()
    return len(a) == len(b) and all(analyzer.can_prove_equal(x, y) for x, y in zip(a, b))


def _shape_mismatch(branch: relax.If, result_ty) -> str:
    """Why selecting between ``branch``'s results would not give each branch's own value
    ("" when it would): both must have one known shape and dtype, which the select's
    result must keep. ``R.where`` broadcasts: (n, 8) against (1, 8) "works" and returns
    (n, 8) rows where the else branch returns one; and where it cannot compute the shape,
    legalization leaves the select to the VM, which cannot run it."""
    tys = [branch.true_branch.body.ty, branch.false_branch.body.ty]
    shapes = [_dims(ty) for ty in tys]
    analyzer = Analyzer()
    if any(s is None for s in shapes):
        return f"a branch's shape is not known ({tys[0]} and {tys[1]})"
    if len({str(ty.dtype) for ty in tys + [result_ty]}) != 1:
        return f"its branches' dtypes differ ({tys[0]} and {tys[1]})"
    if not same_dims(shapes[0], shapes[1], analyzer):
        return (f"its branches' shapes differ ({tys[0]} and {tys[1]}): a select would "
                "broadcast them")
    select = relax.BlockBuilder().normalize(
        relax.op.where(branch.cond, branch.true_branch.body, branch.false_branch.body))
    if _dims(select.ty) is None or not same_dims(_dims(select.ty), shapes[0], analyzer):
        return f"its select's shape ({select.ty}) is not its branches' ({tys[0]})"
    return ""


@function_pass(opt_level=0, name="IfToSelect")
class IfToSelect:
    """Replace ``if`` on a 0-d bool tensor by computing both branches and selecting.

    The rule: both branches are plain bindings of pure relax operators (no calls into
    functions, no packed calls, no allocation, no nested ``if``), at most ``max_ops``
    operators each, none that could trap when its branch is not taken (integer
    division or modulo) or read or write at indices from data (``take``, gathers,
    scatters: the ``if`` may be what keeps them in bounds), and the result is one tensor
    of the same known shape and dtype from either branch (``R.where`` broadcasts: (n, 8) against (1, 8) would give (n, 8)
    where the else branch returns (1, 8); and a shape it cannot compute leaves the select
    unlowered). An ``if`` cheap enough but refused for its shapes keeps its ``if``; why
    goes to the function's ``grape.if_notes`` attribute (``graph_plan``'s notes, shown by
    ``inspect``). Both branches then always run, so
    the condition is never read on the host: the whole function can stay one graph, and
    TVM's fusion, which the ONNX importer's ``if`` turns off, works again
    (``ConvertToDataflow`` after this pass). Larger branches keep their ``if``.

    Before::

        if gv4:
            gv5 = R.add(gv2, R.const(1.0))
            gv7 = gv5
        else:
            gv6 = R.subtract(gv3, R.const(3.0))
            gv7 = gv6

    After::

        gv5 = R.add(gv2, R.const(1.0))
        gv6 = R.subtract(gv3, R.const(3.0))
        gv7 = R.where(gv4, gv5, gv6)
    """

    def __init__(self, max_ops: int = 16):
        self.max_ops = max_ops

    def transform_function(self, func: relax.Function, mod: IRModule,
                           ctx: PassContext) -> relax.Function:
        if not isinstance(func.body, relax.SeqExpr):
            return func
        changed = False
        notes = {}
        blocks = []
        for block in func.body.blocks:
            bindings = []
            for binding in block.bindings:
                why = _shape_mismatch(binding.value, binding.var.ty) \
                    if _cheap(binding, self.max_ops) else None
                if why == "":
                    bindings += self._select(binding)
                    changed = True
                else:
                    if why:
                        notes[binding.var.name] = why
                    bindings.append(binding)
            blocks.append(block.__class__(bindings))
        if not changed and not notes:
            return func
        body = relax.SeqExpr(blocks, func.body.body) if changed else func.body
        new = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)
        return new.with_attr(NOTES_ATTR, notes) if notes else new

    @staticmethod
    def _select(binding: relax.VarBinding) -> list[relax.Binding]:
        branch = binding.value
        hoisted = []
        for side in (branch.true_branch, branch.false_branch):
            hoisted += _branch_bindings(side)
        select = relax.op.where(branch.cond, branch.true_branch.body, branch.false_branch.body)
        return hoisted + [relax.VarBinding(binding.var, select)]
