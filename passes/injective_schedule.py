"""A GPU schedule rule for element-wise kernels over rows of static width and a symbolic
count: no index computed by dividing by a symbolic extent."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight import base
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.target import Target

THREADS_PER_BLOCK = 256
MIN_WIDTH, MAX_WIDTH = 32, 1024  # a warp at least; at most a block's threads
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y
# With a symbolic outermost loop (a batch) on blockIdx.y too, the static loops between it
# and the rows may span at most this much: a batch up to 1024 then stays within the limit.
MAX_STATIC_UNDER_BATCH = 64


class RowsOfStaticWidth(GPUScheduleRule):
    """An injective kernel whose innermost loop has a static extent (the row's width, a
    multiple of 32 up to 1024), whose next loop (the rows) has a symbolic one and whose
    loops above are static except the outermost (a batch).

    dlight's ``Fallback`` fuses every loop into one index and recovers each loop's index
    by dividing by the product of the extents inside it: with a symbolic row count those
    are 64-bit divisions by a runtime value, per element. GPT-2's KV-cache concatenate, a
    copy of (b, 12, past + 1, 64), ran at 0.4 TB/s that way on the H200
    (bench/results/gpt2_step_kernels.json). Here the width is ``threadIdx.x``, rows are
    split over ``blockIdx.x`` and ``threadIdx.y``, and the loops above are fused into
    ``blockIdx.y``: its index is divided only by the static extents below the outermost.

    Before (``Fallback``)::

        for fused in T.thread_binding(..., "blockIdx.x"):      # b * 12 * (p + 1) * 64 / 1024
            for t in T.thread_binding(1024, "threadIdx.x"):
                i = fused * 1024 + t
                b, h = i // (12 * (p + 1) * 64), i // ((p + 1) * 64) % 12   # symbolic divisors
                r, d = i // 64 % (p + 1), i % 64

    After::

        for bh in T.thread_binding(b * 12, "blockIdx.y"):        # b, h = bh // 12, bh % 12
            for r0 in T.thread_binding((p + 1 + 3) // 4, "blockIdx.x"):
                for r1 in T.thread_binding(4, "threadIdx.y"):     # r = r0 * 4 + r1 (< p + 1)
                    for d in T.thread_binding(64, "threadIdx.x"):
    """

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        infos = try_inline(sch, infos)
        if len(infos) != 1 or any(kind != "S" for kind in infos[0].dom_kind()):
            return None
        block = infos[0].block_rv
        loops = sch.get_loops(block)
        extents = [sch.get(loop).extent for loop in loops]
        if not self._fits(extents, base.max_threads_per_block(target)):
            return None
        width = int(extents[-1])
        rows_per_block = max(1, THREADS_PER_BLOCK // width)
        block_x, thread_y = sch.split(loops[-2], factors=[None, rows_per_block])
        sch.bind(loops[-1], "threadIdx.x")
        sch.bind(thread_y, "threadIdx.y")
        sch.bind(block_x, "blockIdx.x")
        if len(loops) > 2:
            sch.bind(sch.fuse(*loops[:-2]), "blockIdx.y")
        return sch

    @staticmethod
    def _fits(extents: list, max_threads: int) -> bool:
        if len(extents) < 2:
            return False
        width, rows = extents[-1], extents[-2]
        if not isinstance(width, tirx.IntImm) or isinstance(rows, tirx.IntImm):
            return False
        if not MIN_WIDTH <= int(width) <= min(MAX_WIDTH, max_threads) or int(width) % 32:
            return False
        # Fused into blockIdx.y, the outer loops' indices divide by the extents below the
        # outermost: those must be static, and the whole within gridDim.y's limit.
        outer = extents[:-2]
        if not all(isinstance(e, tirx.IntImm) for e in outer[1:]):
            return False
        static = 1
        for extent in outer[1:]:
            static *= int(extent)
        if outer and not isinstance(outer[0], tirx.IntImm):
            return static <= MAX_STATIC_UNDER_BATCH
        return static * (int(outer[0]) if outer else 1) <= MAX_GRID_Y
