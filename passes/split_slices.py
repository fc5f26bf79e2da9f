"""A split whose parts are only read one by one becomes a slice per part, which fuses with
what reads it."""

from __future__ import annotations

from dataclasses import dataclass

from tvm import IRModule, relax, tirx
from tvm.ir import Op
from tvm.ir.transform import PassContext, module_pass

from .if_to_select import same_dims
from .var_reads import read_counts

_SPLIT = Op.get("relax.split")
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
    by_part: dict[relax.Var, int] = {}

    def visit(expr):
        if isinstance(expr, relax.TupleGetItem) and isinstance(expr.tuple_value, relax.Var):
            by_part[expr.tuple_value] = by_part.get(expr.tuple_value, 0) + 1

    relax.analysis.post_order_visit(func, visit)
    reads = read_counts(func)
    return {var for var, count in by_part.items() if reads.get(var) == count}


@dataclass(frozen=True, eq=False)
class _Part:
    """A part of a split, as the slice made of it: ``source[.., begin:end, ..]`` on ``axis``."""

    source: relax.Expr
    axis: int
    begin: int
    end: int


def _head_size(part: _Part, shape: relax.ShapeExpr) -> int | None:
    """d, where reshaping ``part`` to ``shape`` splits its source's last axis into heads of
    d (``(.., n, d)``, the part's bounds and the axis multiples of d), else None."""
    dims = list(shape.values)
    source = part.source.ty.shape.values  # static on the axis: ``_parts``
    if part.axis != len(source) - 1 or len(dims) != len(source) + 1 or \
            not all(isinstance(d, tirx.IntImm) for d in dims[-2:]):
        return None
    heads, d = int(dims[-2]), int(dims[-1])
    if part.begin % d or int(source[-1]) % d or heads * d != part.end - part.begin or \
            not same_dims(dims[:-2], source[:-1]):
        return None
    return d


@relax.expr_functor.mutator
class _Slices(relax.PyExprMutator):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.sliceable: set[relax.Var] = set()
        # The slices made of a split's parts, by the slice: only those become slices of
        # heads. An export's own slice of the last axis, reshaped into heads the same way,
        # made TVM 0.27's FuseTIR fail ("Inconsistent buffers ... mapped to the same relax
        # var") on tests/test_loop.py's decoder step.
        self.parts: dict[relax.Call, _Part] = {}
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
        part = _Part(call.args[0], axis, *bounds[item.index])
        self.rewritten += 1
        sliced = relax.op.strided_slice(part.source, [axis], [part.begin], [part.end],
                                        assume_inbound=True)
        self.parts[sliced] = part
        return sliced

    def visit_call_(self, op: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        """A part reshaped into heads: a slice of heads of the source's reshape (a view)."""
        call = super().visit_call_(op)
        if call.op != _RESHAPE or not isinstance(call.args[0], relax.Var) or \
                not isinstance(call.args[1], relax.ShapeExpr):
            return call
        part = self.parts.get(self.lookup_binding(call.args[0]))
        d = None if part is None else _head_size(part, call.args[1])
        if d is None:
            return call
        source = part.source.ty.shape.values
        heads = relax.op.reshape(part.source, [*source[:-1], int(source[-1]) // d, d])
        self.rewritten += 1
        return relax.op.strided_slice(heads, [part.axis], [part.begin // d], [part.end // d],
                                      assume_inbound=True)


@module_pass(opt_level=0, name="SplitAsSlices")
class SplitAsSlices:
    """Read the parts of a split as slices that fuse with their readers. A ``split`` whose
    result is only read part by part (its axis static, its cuts within it) becomes one
    ``strided_slice`` per part read; a part of the last axis reshaped into heads becomes a
    slice of heads after a reshape of the whole. TVM legalizes a split into one kernel
    writing every part, and a reshape is a kernel boundary for ``FuseOps`` (``kOpaque``: it
    is to become a view); with both gone, each part's slice fuses with its transpose
    (attention's q, k and v) and no kernel writes the parts: GPT-2's qkv split took three
    kernels and the q and k transposes two more.

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
