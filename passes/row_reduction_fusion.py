"""A row reduction takes its element-wise producers: attention's scale and mask join its
softmax's kernel."""

from __future__ import annotations

from tvm import IRModule, s_tir, tirx
from tvm.ir.transform import PassContext, module_pass
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline_contiguous_spatial

from .row_reduction import row_reduction_iters

# TVM's OpPatternKind (include/tvm/relax/op_attr_types.h).
_COMM_REDUCE, _OUT_ELEMWISE_FUSABLE = 3, 4


def is_row_reduction(func: tirx.PrimFunc) -> bool:
    """Reductions over the row, then one element-wise block of the row: softmax, layer
    norm, RMS norm (``row_reduction.row_reduction_iters``), after its spatial prologues
    (a half-precision softmax's cast to fp32) are inlined."""
    try:
        sch = s_tir.Schedule(func)
        infos = try_inline_contiguous_spatial(sch, normalize_prim_func(sch))
    except Exception:  # pylint: disable=broad-except
        return False  # a body dlight cannot analyze is no row reduction of ours
    return row_reduction_iters(infos) is not None


@module_pass(opt_level=0, name="FuseIntoRowReductions")
class FuseIntoRowReductions:
    """Annotate a row reduction's PrimFunc (``is_row_reduction``) as a reduction
    (``kCommReduce``), not ``kOutEWiseFusable``, so that ``FuseOps`` fuses its element-wise
    and broadcast producers into it, as it does for a plain reduction: the kernel reads its
    row through them, computing them once per read (three for softmax) instead of a kernel
    writing them out. Between ``AnnotateTIROpPattern`` and ``FuseOps``.

    TVM's own annotation lets a softmax take its consumers instead; where a row reduction is
    followed by an element-wise consumer, that consumer is now a kernel of its own. In
    attention, the softmax's consumer is the product with v, and its producers are the
    scores' scale and mask: GPT-2's fp16 prefill at 1024 tokens spent 57 us a call on that
    kernel, 92% of its softmax's 61 us
    (bench/results/gpt2_prefill_kernels.fp16_1024.dee4d5c.json).

    Before::

        lv = R.call_tir(multiply, (s, c))      # the scores' scale
        lv1 = R.call_tir(add, (lv, mask))      # the causal mask, broadcast over heads
        p = R.call_tir(softmax, (lv1,))        # softmax's op_pattern: kOutEWiseFusable

    After ``FuseOps`` and ``FuseTIR``::

        p = R.call_tir(fused_multiply_add_softmax, (s, c, mask))  # softmax: kCommReduce
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc) and func.attrs is not None and \
                    int(func.attrs.get("op_pattern", -1)) == _OUT_ELEMWISE_FUSABLE and \
                    is_row_reduction(func):
                updates[gvar] = func.with_attr("op_pattern", _COMM_REDUCE)
        if not updates:
            return mod
        return IRModule({**dict(mod.functions), **updates}, attrs=mod.attrs,
                        global_infos=mod.global_infos)
