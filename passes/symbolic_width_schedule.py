"""A GPU schedule rule for element-wise kernels over a symbolic number of rows of symbolic
width (attention's scores): no index computed per element by dividing by a symbolic extent."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.target import Target

from .injective_schedule import (THREADS_PER_BLOCK, injective_loops, outer_loops_fit_grid_y,
                                 symbolic_below_the_batch)


class RowsOfSymbolicWidth(GPUScheduleRule):
    """An injective kernel whose two innermost loops are symbolic (rows of a symbolic width:
    a prefill's causal mask, [b, 1, s, s], or its scores' scale and mask where no softmax
    follows them: ``FuseIntoRowReductions`` puts those into it), the rows' not the
    outermost, and whose loops above are static except the outermost (a batch).

    ``Fallback`` recovers every index from one fused index by 64-bit divisions by the
    symbolic extents, per element: GPT-2's fp16 prefill at 1024 tokens spent 57 us a call
    on its scores' scale and mask that way, 7x its DRAM bound
    (bench/results/gpt2_prefill_kernels.fp16_1024.dee4d5c.json). Here a block of
    ``THREADS_PER_BLOCK`` threads walks one row in strides (each thread every 256th
    element, a warp's 32 neighbours at a time), the row is ``blockIdx.x`` and the loops
    above are fused into ``blockIdx.y``, as in ``RowsOfStaticWidth``. Rows of a batch alone
    or a static number of them (an expand_dims of (b, samples), a decode step's
    [b, h, 1, past]) stay with ``Fallback``: a block per row would leave most of the GPU
    idle.

    Before (``Fallback``)::

        for fused in T.thread_binding((b * 12 * s * s + 1023) // 1024, "blockIdx.x"):
            for t in T.thread_binding(1024, "threadIdx.x"):
                i = fused * 1024 + t
                b_, h = i // (s * s * 12), i % (s * s * 12) // (s * s)   # symbolic divisors
                r, c = i % (s * s) // s, i % s

    After::

        for bh in T.thread_binding(b * 12, "blockIdx.y"):         # b, h = bh // 12, bh % 12
            for r in T.thread_binding(s, "blockIdx.x"):
                for t in T.thread_binding(256, "threadIdx.x"):
                    for c in range((s + 255) // 256):              # column c * 256 + t (< s)
    """

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        found = injective_loops(self, func, target)
        if found is None:
            return None
        sch, loops, extents = found.sch, found.loops, found.extents
        # The rows symbolic too: the loops above them must be static but the outermost.
        if not self.rows_of_a_sequence(extents[:-1]) or isinstance(extents[-1], tirx.IntImm):
            return None
        if not outer_loops_fit_grid_y(extents[:-2]):
            return None
        strides, thread_x = sch.split(loops[-1], factors=[None, THREADS_PER_BLOCK])
        sch.reorder(thread_x, strides)
        sch.bind(thread_x, "threadIdx.x")
        sch.bind(loops[-2], "blockIdx.x")
        if len(loops) > 2:
            sch.bind(sch.fuse(*loops[:-2]), "blockIdx.y")
        return sch

    rows_of_a_sequence = staticmethod(symbolic_below_the_batch)
