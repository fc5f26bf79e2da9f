"""A slice that drops a convolution's last outputs becomes less padding on that side."""

from __future__ import annotations

from tvm import IRModule, relax, tirx
from tvm.ir import Op
from tvm.ir.transform import PassContext
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.relax.transform import function_pass
from tvm.sym.analyzer import Analyzer

# Conv ops with their spatial axes in the data layout and where each axis's end padding sits
# in ``padding`` (conv1d: [left, right]; conv2d: [top, left, bottom, right]).
_CONVS = {"relax.nn.conv1d": ("NCW", 1), "relax.nn.conv2d": ("NCHW", 2)}
# Element-wise ops that may stand between the conv and the slice, their other operand
# broadcast along the sliced axes (a bias): slicing after them equals slicing before.
_ELEMENTWISE = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide"}


def _ints(values) -> list[int] | None:
    out = []
    for value in values:
        if not isinstance(value, tirx.IntImm):
            return None
        out.append(int(value.value))
    return out


def _shape(expr: relax.Expr) -> list[tirx.PrimExpr] | None:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return list(ty.shape.values)


def _broadcast_along(other: relax.Expr, rank: int, axes: list[int]) -> bool:
    """``other``, broadcast to ``rank`` dims, has extent 1 (or no dim) on every axis."""
    shape = _shape(other)
    if shape is None or len(shape) > rank:
        return False
    lead = rank - len(shape)
    return all(a < lead or (isinstance(shape[a - lead], tirx.IntImm)
                            and int(shape[a - lead].value) == 1) for a in axes)


class _Match:
    """A ``strided_slice`` whose input is a conv followed by broadcast element-wise ops."""

    def __init__(self, conv: relax.Call, chain: list[tuple[relax.Call, int]],
                 padding: list[int]):
        self.conv, self.chain, self.padding = conv, chain, padding


def _match(call: relax.Call, var2val, uses) -> _Match | None:
    if not (isinstance(call.op, Op) and call.op.name == "relax.strided_slice"):
        return None
    strides = call.args[4] if len(call.args) > 4 else None
    axes, begins = _ints(call.args[1]), _ints(call.args[2])
    ends = list(call.args[3].fields)
    rank = len(_shape(call.args[0]) or [])
    if axes is None or not rank:
        return None
    axes = [a + rank if a < 0 else a for a in axes]
    if begins is None or begins is None or any(begins) or \
            (strides is not None and _ints(strides) != [1] * len(axes)):
        return None
    # Walk back from the slice's input through single-use element-wise ops to a conv.
    chain: list[tuple[relax.Call, int]] = []
    source = call.args[0]
    while True:
        if not isinstance(source, relax.DataflowVar) or len(uses.get(source, ())) != 1:
            return None
        value = var2val.get(source)
        if not isinstance(value, relax.Call) or not isinstance(value.op, Op):
            return None
        if value.op.name in _CONVS:
            break
        if value.op.name not in _ELEMENTWISE or len(value.args) != 2:
            return None
        # The operand that continues the chain has the full rank and is not broadcast
        # along the axes; the other (a bias) is.
        first, second = value.args
        full = [len(_shape(a) or []) == rank and not _broadcast_along(a, rank, axes)
                for a in (first, second)]
        if full[0] and not full[1] and _broadcast_along(second, rank, axes):
            chain.append((value, 0))
            source = first
        elif full[1] and not full[0] and _broadcast_along(first, rank, axes):
            chain.append((value, 1))
            source = second
        else:
            return None
    conv = value
    layout, spatial = _CONVS[conv.op.name]
    attrs = conv.attrs
    if str(attrs.data_layout) != layout or str(attrs.out_layout) != layout:
        return None
    shape = _shape(conv)
    padding = [int(p) for p in attrs.padding]
    strides = [int(s) for s in attrs.strides]
    if shape is None or len(shape) != rank or len(padding) != 2 * spatial:
        return None
    analyzer = Analyzer()
    for axis, end in zip(axes, ends):
        if axis < 2 or axis >= 2 + spatial:
            return None
        dropped = analyzer.simplify(shape[axis] - end)
        if not isinstance(dropped, tirx.IntImm) or int(dropped.value) < 1:
            return None
        right = spatial + axis - 2  # where this axis's end padding sits
        # Fewer outputs by ``dropped``: the end padding shrinks by ``dropped * stride``.
        padding[right] -= int(dropped.value) * strides[axis - 2]
        if padding[right] < 0:
            return None
    return _Match(conv, list(reversed(chain)), padding)


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule | None, var2val, uses):
        super().__init__(mod)
        self.var2val, self.uses = var2val, uses
        self.count = 0

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        found = _match(value, self.var2val, self.uses) if isinstance(value, relax.Call) else None
        if found is None:
            super().visit_var_binding_(binding)
            return
        conv, attrs = found.conv, found.conv.attrs
        make = relax.op.nn.conv1d if conv.op.name == "relax.nn.conv1d" else relax.op.nn.conv2d
        new = self.builder_.emit(make(
            self.visit_expr(conv.args[0]), self.visit_expr(conv.args[1]),
            strides=[int(s) for s in attrs.strides], padding=found.padding,
            dilation=[int(d) for d in attrs.dilation], groups=int(attrs.groups),
            data_layout=str(attrs.data_layout), kernel_layout=str(attrs.kernel_layout),
            out_layout=str(attrs.out_layout),
            out_dtype=attrs.out_dtype),
            binding.var.name + "_conv")
        for call, side in found.chain:
            args = [self.visit_expr(a) for a in call.args]
            args[side] = new
            new = self.builder_.emit(relax.Call(call.op, args, call.attrs),
                                     binding.var.name + "_" + call.op.name.split(".")[-1])
        analyzer = Analyzer()
        want, got = _shape(binding.var), _shape(new)
        if want is not None and got is not None and len(want) == len(got) and \
                all(analyzer.can_prove_equal(a, b) for a, b in zip(want, got)):
            self.count += 1
            self.set_var_remap(binding.var, new)
            return
        super().visit_var_binding_(binding)  # pragma: no cover - shapes always agree


@function_pass(opt_level=0, name="SliceIntoConvPadding")
class SliceIntoConvPadding:
    """``strided_slice(conv(x), axis, 0, L - k)`` becomes ``conv(x)`` with ``k * stride``
    less end padding on that axis: the same values, without the slice.

    A convolution whose padding makes one output too many, trimmed by a slice, is how
    PyTorch writes "same" padding for an even kernel (Wav2Vec2's positional convolution,
    ``Wav2Vec2SamePadLayer``: kernel 128, padding 64, ``[..., :-1]``). TVM fuses the conv,
    its bias add and the slice into one kernel whose output extents differ from the
    reduction's; dlight's ``GeneralReduction`` then keeps the whole conv output for one
    batch row in shared memory, a buffer sized by the symbolic frame count, and CUDA
    codegen fails ("Can only handle constant size stack allocation"). Without the slice the
    conv and its bias schedule as a plain reduction with an element-wise epilogue.

    Matched: conv1d (NCW) or conv2d (NCHW), then any single-use ``add``/``subtract``/
    ``multiply``/``divide`` whose other operand broadcasts along the sliced axes (a bias),
    then a stride-1 ``strided_slice`` from 0 on spatial axes dropping a constant number of
    trailing outputs that the end padding covers. Output ``i`` of a conv reads input
    ``i * stride - pad_begin + j * dilation``: independent of the end padding, which only
    sets how many outputs there are (``k * stride`` less padding, ``k`` fewer outputs).

    Before (``n`` frames)::

        c = R.nn.conv1d(x, w, padding=[8, 8], groups=2)      # (1, 32, n + 1)
        b = R.add(c, bias)                                   # bias: (1, 32, 1)
        y = R.strided_slice(b, (2,), (0,), (n,))             # (1, 32, n)

    After::

        y_conv = R.nn.conv1d(x, w, padding=[8, 7], groups=2)  # (1, 32, n)
        y = R.add(y_conv, bias)
    """

    def transform_function(self, func: relax.Function, mod: IRModule,
                           ctx: PassContext) -> relax.Function:
        if not isinstance(func, relax.Function):
            return func
        uses = {}
        var2val = relax.analysis.get_var2val(func)
        for block in _dataflow_blocks(func):
            for var, users in relax.analysis.udchain(block).items():
                uses[var] = list(users)
        if not any(_match(v, var2val, uses) for v in var2val.values()
                   if isinstance(v, relax.Call)):
            return func
        rewriter = _Rewriter(mod, var2val, uses)
        new = rewriter.visit_expr(func)
        return relax.analysis.remove_all_unused(new)


def _dataflow_blocks(func: relax.Function) -> list[relax.DataflowBlock]:
    blocks = []

    def visit(node):
        if isinstance(node, relax.SeqExpr):
            blocks.extend(b for b in node.blocks if isinstance(b, relax.DataflowBlock))

    relax.analysis.post_order_visit(func.body, visit)
    return blocks
