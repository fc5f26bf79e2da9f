"""A split whose parts are only read one by one becomes a slice per part, which fuses with
what reads it."""

from __future__ import annotations

from tvm import IRModule, relax, tirx
from tvm.ir import Op
from tvm.ir.transform import PassContext, module_pass

from .if_to_select import same_dims

_SPLIT = Op.get("relax.split")
_SLICE = Op.get("relax.strided_slice")
_RESHAPE = Op.get("relax.reshape")


def _parts(call: relax.Call) -> tuple[int, list[tuple[int, int]]] | None:
    """The split's axis (non-negative) and the (begin, end) of each part along it, or None
    unless the axis is static and every cut within it (a cut past a shorter axis gives an
    empty part, which a slice assumed in bounds would not)."""
    ty = call.args[0].ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    axis = int(call.attrs.axis) % ty.ndim
    extent = ty.shape.values[axis]
    if not isinstance(extent, tirx.IntImm):
        return None
    extent = int(extent)
    split = call.attrs.indices_or_sections
    if isinstance(split, (int, tirx.IntImm)):
        sections = int(split)
        if extent % sections:
            return None
        size = extent // sections
        return axis, [(i * size, (i + 1) * size) for i in range(sections)]
    cuts = [0, *(int(i) for i in split), extent]
    if any(a > b for a, b in zip(cuts[:-1], cuts[1:])):
        return None
    return axis, list(zip(cuts[:-1], cuts[1:]))


def _read_only_by_part(func: relax.Function) -> set[relax.Var]:
    """Variables every read of which is a ``TupleGetItem``."""
    reads: dict[relax.Var, int] = {}
    by_part: dict[relax.Var, int] = {}

    def visit(expr):
        if isinstance(expr, relax.Var):
            reads[expr] = reads.get(expr, 0) + 1
        elif isinstance(expr, relax.TupleGetItem) and isinstance(expr.tuple_value, relax.Var):
            by_part[expr.tuple_value] = by_part.get(expr.tuple_value, 0) + 1

    relax.analysis.post_order_visit(func, visit)
    return {var for var, count in by_part.items() if reads.get(var) == count}


def _static(values: relax.Expr) -> list[int] | None:
    """A tuple of static integers (a slice's axes, begins, ends) as ints."""
    if not isinstance(values, relax.Tuple):
        return None
    found = list(values.fields)
    return [int(v) for v in found] if all(isinstance(v, tirx.IntImm) for v in found) else None


def _heads_of_slice(call: relax.Call, reshape_shape) -> relax.Expr | None:
    """``reshape(strided_slice(x, last axis, [a, b)), (.., n, d))``, with a and b multiples
    of d, as ``strided_slice(reshape(x, (.., X / d, d)), axis -2, [a / d, b / d))``: the
    reshape of x is a view, and the slice fuses with what reads it."""
    x = call.args[0]
    x_ty = x.ty
    if not isinstance(x_ty, relax.TensorType) or x_ty.shape is None or len(call.args) < 4:
        return None
    axes, begin, end = (_static(a) for a in call.args[1:4])
    rank = x_ty.ndim
    if axes is None or begin is None or end is None or len(axes) != 1 or \
            axes[0] % rank != rank - 1 or (len(call.args) > 4 and call.args[4] is not None):
        return None
    width = x_ty.shape.values[-1]
    target = list(reshape_shape.values)
    if not isinstance(width, tirx.IntImm) or len(target) != rank + 1 or \
            not isinstance(target[-1], tirx.IntImm):
        return None
    d = int(target[-1])
    if not 0 <= begin[0] < end[0] <= int(width) or begin[0] % d or end[0] % d or \
            int(width) % d or \
            not same_dims(target[:-2], x_ty.shape.values[:-1]) or \
            not isinstance(target[-2], tirx.IntImm) or int(target[-2]) * d != end[0] - begin[0]:
        return None
    heads = relax.op.reshape(x, [*x_ty.shape.values[:-1], int(width) // d, d])
    return relax.op.strided_slice(heads, [rank - 1], [begin[0] // d], [end[0] // d],
                                  assume_inbound=True)


@relax.expr_functor.mutator
class _Slices(relax.PyExprMutator):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.sliceable: set[relax.Var] = set()
        # The slices made of a split's parts: only those become slices of heads. An export's
        # own slice of the last axis, reshaped into heads the same way, made TVM 0.27's
        # FuseTIR fail ("Inconsistent buffers ... mapped to the same relax var") on
        # tests/test_loop.py's decoder step.
        self.parts: set[relax.Call] = set()
        self.rewritten = 0

    def visit_tuple_getitem_(self, op: relax.TupleGetItem) -> relax.Expr:  # pylint: disable=arguments-renamed
        item = super().visit_tuple_getitem_(op)
        split = item.tuple_value
        if not isinstance(split, relax.Var) or split not in self.sliceable:
            return item
        call = self.lookup_binding(split)
        if not isinstance(call, relax.Call) or call.op != _SPLIT:
            return item
        parts = _parts(call)
        if parts is None:
            return item
        axis, bounds = parts
        begin, end = bounds[item.index]
        self.rewritten += 1
        part = relax.op.strided_slice(call.args[0], [axis], [begin], [end], assume_inbound=True)
        self.parts.add(part)
        return part

    def visit_call_(self, op: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(op)
        if call.op != _RESHAPE or not isinstance(call.args[0], relax.Var) or \
                not isinstance(call.args[1], relax.ShapeExpr):
            return call
        sliced = self.lookup_binding(call.args[0])
        if not isinstance(sliced, relax.Call) or sliced not in self.parts:
            return call
        heads = _heads_of_slice(sliced, call.args[1])
        if heads is None:
            return call
        self.rewritten += 1
        return heads


@module_pass(opt_level=0, name="SplitAsSlices")
class SplitAsSlices:
    """Read the parts of a split as slices that fuse with their readers. A ``split`` whose
    result is only read part by part (its axis static, its cuts within it) becomes one
    ``strided_slice`` per part read; a part of the last axis reshaped into heads becomes a
    slice of heads after a reshape of the whole. TVM
    legalizes a split into one kernel writing every part, and a reshape is a kernel
    boundary for ``FuseOps`` (``kOpaque``: it is to become a view); with both gone, each
    part's slice fuses with its transpose (attention's q, k and v) and no kernel writes the
    parts: GPT-2's qkv split took three kernels and the q and k transposes two more.

    Before::

        qkv = R.split(x, indices_or_sections=[768, 1536], axis=2)   # x: (b, s, 2304)
        q = R.permute_dims(R.reshape(qkv[0], (b, s, 12, 64)), [0, 2, 1, 3])
        v = qkv[2]

    After::

        heads = R.reshape(x, (b, s, 36, 64))                         # a view
        q = R.permute_dims(R.strided_slice(heads, axes=[2], begin=[0], end=[12],
                                           assume_inbound=True), [0, 2, 1, 3])
        v = R.strided_slice(x, axes=[2], begin=[1536], end=[2304], assume_inbound=True)
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        slices = _Slices(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                slices.sliceable = _read_only_by_part(func)
                if slices.sliceable:
                    new = slices.visit_expr(func)
                    slices.builder_.update_func(gvar, relax.analysis.remove_all_unused(new))
        return slices.builder_.get() if slices.rewritten else mod
