"""A GPU schedule rule for row reductions over the rows of a sequence (softmax, layer norm):
one warp per row."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline_contiguous_spatial
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.target import Target

from .injective_schedule import outer_loops_fit_grid_y, symbolic_below_the_batch

WARP = 32


def _is_one(extent) -> bool:
    return isinstance(extent, tirx.IntImm) and int(extent) == 1


def row_reduction_iters(infos) -> int | None:
    """The number of leading spatial iters when ``infos`` are reductions ``S..SR..R`` of one
    shape followed by one element-wise block over the same iters (softmax: its max, its sum
    of exponentials, then the quotient; layer norm: mean, variance, then the normalized
    row), else None."""
    if infos is None or len(infos) < 2:
        return None
    kinds = infos[0].dom_kind()
    leading = len(kinds) - len(kinds.lstrip("S"))
    if not 0 < leading < len(kinds) or kinds[leading:].strip("R"):
        return None
    if any(info.dom_kind() != kinds for info in infos[1:-1]):
        return None
    last = infos[-1]
    if not last.is_injective() or last.dom_kind() != "S" * len(kinds):
        return None
    return leading


class RowReductionPerWarp(GPUScheduleRule):
    """Row reductions followed by an element-wise block over the row (softmax, layer norm,
    RMS norm), over the rows of a sequence (``rows_of_a_sequence``): one warp per row, its
    reductions warp shuffles alone.

    dlight's ``GeneralReduction`` gives each row a block of 256 threads, whose all-reduces
    go through shared memory with a barrier each: a chain of latencies per row that a
    symbolic number of rows repeats in waves. GPT-2's fp16 prefill at 1024 tokens spent 61
    us a call on its softmax that way (12 x 1024 rows of 1024, 8.6x the DRAM bound;
    bench/results/gpt2_prefill_kernels.fp16_1024.dee4d5c.json). Here a block is one warp:
    32 blocks per SM keep as many rows in flight, and TVM lowers an all-reduce over 32
    ``threadIdx.x`` to shuffles.

    Before (``GeneralReduction``)::

        for row in T.thread_binding(b * 12 * s, "blockIdx.x"):
            for t in T.thread_binding(256, "threadIdx.x"):   # each of max, sum, quotient
                for c in range((s + 255) // 256): ...

    After (the batch and heads on ``blockIdx.y`` where they fit, so that no index divides
    by the symbolic rows)::

        for bh in T.thread_binding(b * 12, "blockIdx.y"):
            for row in T.thread_binding(s, "blockIdx.x"):
                for t in T.thread_binding(32, "threadIdx.x"):
                    for c in range((s + 31) // 32): ...
    """

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = try_inline_contiguous_spatial(sch, normalize_prim_func(sch))
        leading = row_reduction_iters(infos)
        if leading is None:
            return None
        loops = sch.get_loops(infos[-1].block_rv)
        extents = [sch.get(loop).extent for loop in loops[:leading]]
        if not self.rows_of_a_sequence(extents):
            return None
        if leading > 1 and outer_loops_fit_grid_y(extents[:-1]):
            # The sequence's rows on blockIdx.x, the batch (and heads) on blockIdx.y: a
            # row's indices then divide by static extents alone. Fused into blockIdx.x,
            # every element read through a broadcast (attention's mask) divides by the
            # symbolic rows, in 64 bits, inside the loop. gridDim.y's limit bounds the
            # batch (``outer_loops_fit_grid_y``).
            sch.bind(sch.fuse(*loops[:leading - 1]), "blockIdx.y")
            row, depth = loops[leading - 1], 2
        else:
            row, depth = sch.fuse(*loops[:leading]), 1
        sch.bind(row, "blockIdx.x")
        self._over_warp(sch, sch.fuse(*loops[leading:]))
        reduced = len(loops) - leading
        for info in reversed(infos[:-1]):
            for index, _ in enumerate(sch.get(info.block_rv).writes):
                sch.set_scope(info.block_rv, buffer_index=index, storage_scope="shared")
            sch.compute_at(info.block_rv, row, preserve_unit_loops=True)
            # At the row, a reduction must be one element of it: its spatial loops unit.
            # Not so when it reduces another axis than the row's (a softmax over axis 1):
            # each row would recompute a symbolic number of them.
            spatial = sch.get_loops(info.block_rv)[depth:-reduced]
            if any(not _is_one(sch.get(loop).extent) for loop in spatial):
                return None
            self._over_warp(sch, sch.fuse(*sch.get_loops(info.block_rv)[-reduced:]))
        return sch

    # Rows of a batch alone (a decode step: b rows of layer norm, b x 12 of softmax) stay
    # with GeneralReduction, whose 256 threads a row read it faster when the rows are too
    # few to fill the GPU: with a warp per row, GPT-2's decode step at past 256 spent 24 us
    # more on its layer norms and softmaxes (ncu on the H200,
    # bench/results/gpt2_step_kernels.row_rules_unrestricted.json).
    rows_of_a_sequence = staticmethod(symbolic_below_the_batch)

    @staticmethod
    def _over_warp(sch: s_tir.Schedule, loop) -> None:
        """The row's loop as a warp's lanes, each striding over the row."""
        strides, lane = sch.split(loop, factors=[None, WARP])
        sch.reorder(lane, strides)
        sch.bind(lane, "threadIdx.x")
