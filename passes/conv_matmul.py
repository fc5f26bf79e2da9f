"""A 1-D convolution becomes a gather of its windows and a matmul (implicit GEMM, im2col).

TVM 0.27 has no fast GPU schedule for ``conv1d`` over a symbolic length: Wav2Vec2's
feature-extractor convolutions and its grouped positional convolution (kernel 128) take 65%
of its GPU time at 16 s of audio (``bench/results/wav2vec2_kernels.tvm_conv.json``). As a matmul,
the convolution runs on cuBLASLt (``OffloadMatmul`` takes the product, batched over the
groups), and the gather is a kernel of its own. It is not marked injective: fused with its
producer (the previous layer's GELU) FuseTIR fails, as the gather's PrimFunc, made here,
spells a derived length in the model's dims and the producer, legalized after
``NameDerivedDims``, in the dim that pass names.
"""

from __future__ import annotations

from tvm import IRModule, relax, te, tirx
from tvm.ir import Op
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.ir.transform import PassContext, module_pass

from .library_matmul import LIBRARY_DTYPES, static_dims

_CONV1D = Op.get("relax.nn.conv1d")
# Below this many products per output, the matmul's reduction is too short to pay for the
# gathered copy of the input (Wav2Vec2's first layer, 1 channel by kernel 10, stays TVM's).
MIN_REDUCTION = 32


def windows(x: te.Tensor, rows: tirx.PrimExpr, groups: int, kernel: int, stride: int,
            dilation: int, pad_left: int) -> te.Tensor:
    """The windows of ``x`` ([N, C, L]) as matmul rows: ``out[g, n * T + t, c * kernel + j]
    = x[n, g * Cg + c, t * stride + j * dilation - pad_left]`` (0 in the padding), T =
    ``rows``; [N * T, C * kernel] when ``groups`` is 1. The kernel's taps are the fastest
    axis, as in the OIW weight (``[O, C * kernel]`` is a view of it), so that neighbouring
    threads read neighbouring positions of one channel of the NCW input."""
    n_extent, channels, length = x.shape
    per_group = channels // groups
    one_batch = isinstance(n_extent, tirx.IntImm) and int(n_extent) == 1

    def element(g, r, q):
        n = tirx.const(0, str(r.ty)) if one_batch else tirx.floordiv(r, rows)
        t = r if one_batch else tirx.floormod(r, rows)
        c, j = tirx.floordiv(q, kernel), tirx.floormod(q, kernel)
        pos = t * stride + j * dilation - pad_left
        inside = tirx.all(pos >= 0, pos < length)
        value = x[n, g * per_group + c, tirx.if_then_else(inside, pos, 0)]
        return tirx.if_then_else(inside, value, tirx.const(0, x.dtype))

    shape = (n_extent * rows, kernel * per_group)
    if groups == 1:
        return te.compute(shape, lambda r, q: element(0, r, q), name="conv_windows")
    return te.compute((groups, *shape), element, name="conv_windows")


@mutator
class _ConvToMatmul(PyExprMutator):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.rewritten = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if call.op != _CONV1D:
            return call
        new = self._rewrite(call)
        if new is None:
            return call
        self.rewritten += 1
        return new

    def _rewrite(self, call: relax.Call) -> relax.Expr | None:
        x, w = call.args
        attrs = call.attrs
        if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NCW", "OIW", "NCW"):
            return None
        out_ty, x_ty, w_ty = call.ty, x.ty, w.ty
        dtype = str(out_ty.dtype)
        if dtype not in LIBRARY_DTYPES or str(x_ty.dtype) != dtype or str(w_ty.dtype) != dtype:
            return None
        w_dims = static_dims(w_ty)
        if x_ty.shape is None or out_ty.shape is None or w_dims is None:
            return None
        channels = x_ty.shape.values[1]
        out_channels, per_group, kernel = w_dims
        groups = int(attrs.groups)
        if not isinstance(channels, tirx.IntImm) or per_group * groups != int(channels):
            return None
        if per_group * kernel < MIN_REDUCTION:
            return None
        (stride,), (dilation,) = attrs.strides, attrs.dilation
        stride, dilation, pad_left = int(stride), int(dilation), int(attrs.padding[0])
        batch, _, length = out_ty.shape.values
        cols = self.builder_.call_te(windows, x, length, groups, kernel, stride, dilation,
                                     pad_left, primfunc_name_hint="conv_windows")
        cols = self.builder_.emit(cols)
        product = self._product(cols, w, groups, out_channels // groups, per_group, kernel)
        return self._to_ncw(product, batch, length, groups, out_channels)

    def _product(self, cols, w, groups: int, out_per_group: int, per_group: int, kernel: int):
        """cols @ w, w ordered as the windows: [O, Cg * k] (a view of the OIW weight) used
        transposed, as an nn.Linear weight, for one group; [g, Cg * k, O / g] batched over
        the groups."""
        emit, op = self.builder_.emit, relax.op
        if groups == 1:
            w_rows = emit(op.reshape(w, [out_per_group, per_group * kernel]))
            return emit(op.matmul(cols, emit(op.permute_dims(w_rows, [1, 0]))))
        w_rows = emit(op.reshape(w, [groups, out_per_group, per_group * kernel]))
        return emit(op.matmul(cols, emit(op.permute_dims(w_rows, [0, 2, 1]))))

    def _to_ncw(self, product, batch, length, groups: int, out_channels: int) -> relax.Expr:
        """The matmul's rows (n, t) back to the conv's [N, O, T]."""
        emit, op = self.builder_.emit, relax.op
        if groups == 1:
            rows = emit(op.reshape(product, [batch, length, out_channels]))
            return op.permute_dims(rows, [0, 2, 1])
        rows = emit(op.reshape(product, [groups, batch, length, out_channels // groups]))
        return op.reshape(emit(op.permute_dims(rows, [1, 0, 3, 2])),
                          [batch, out_channels, length])


@module_pass(opt_level=0, name="Conv1dAsMatmul")
class Conv1dAsMatmul:
    """Rewrite ``conv1d`` (NCW data, OIW weight of static shape, any stride, padding,
    dilation and groups; float dtypes cuBLASLt takes) into the gather of its windows
    (``windows``) and a matmul, for ``OffloadMatmul`` to give to cuBLASLt. A conv whose
    reduction (channels per group times kernel) is under ``MIN_REDUCTION`` stays.

    Before (Wav2Vec2's second feature-extractor layer)::

        y = R.nn.conv1d(x, w, strides=[2])      # x: (n, 512, l), w: (512, 512, 3), y: (n, 512, t)

    After::

        cols = R.call_tir(conv_windows, (x,), R.Tensor((n * t, 1536)))  # cols[n*t+t', c*3+j]
        w_rows = R.reshape(w, [512, 1536])                              # a view
        prod = R.matmul(cols, R.permute_dims(w_rows, [1, 0]))          # (n * t, 512)
        y = R.permute_dims(R.reshape(prod, [n, t, 512]), [0, 2, 1])

    With groups g (the positional convolution: 768 channels, g = 16, kernel 128) the
    windows are [g, n * t, Cg * k], the weight [g, Cg * k, O / g] and the matmul batched
    over the groups.
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        rewriter = _ConvToMatmul(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                new = rewriter.visit_expr(func)
                rewriter.builder_.update_func(gvar, relax.analysis.remove_all_unused(new))
        return rewriter.builder_.get() if rewriter.rewritten else mod
