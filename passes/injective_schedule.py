"""A GPU schedule rule for element-wise kernels over rows of static width and a symbolic
count: no index computed by dividing by a symbolic extent."""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.s_tir.dlight import base
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.target import Target

THREADS_PER_BLOCK = 256
MIN_WIDTH = 32  # a warp at least
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y
# With a symbolic outermost loop (a batch) on blockIdx.y too, the static loops between it
# and the rows may span at most this much: a batch up to 1023 then stays within the limit.
MAX_STATIC_UNDER_BATCH = 64


class RowsOfStaticWidth(GPUScheduleRule):
    """An injective kernel whose innermost loop has a static extent (the row's width, a
    multiple of 32), whose next loop (the rows) has a symbolic one and whose loops above
    are static except the outermost (a batch). A row wider than a block's threads is split
    over the largest multiple of 32 threads that divides it, each thread looping over its
    part (a conv's windows, 6144 wide: 1024 threads, 6 elements each).

    dlight's ``Fallback`` fuses every loop into one index and recovers each loop's index
    by dividing by the product of the extents inside it: with a symbolic row count those
    are 64-bit divisions by a runtime value, per element. GPT-2's KV-cache concatenate, a
    copy of (b, 12, past + 1, 64), ran at 0.4 TB/s that way on the H200
    (bench/README.md, "Where the GPT-2 decode step's GPU time went"). Here the width is ``threadIdx.x``, rows are
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
        found = injective_loops(self, func, target)
        if found is None:
            return None
        sch, loops, extents = found.sch, found.loops, found.extents
        threads = self._threads(extents, base.max_threads_per_block(target))
        if threads is None:
            return None
        width = int(extents[-1])
        rows_per_block = max(1, THREADS_PER_BLOCK // threads)
        block_x, thread_y = sch.split(loops[-2], factors=[None, rows_per_block])
        if threads < width:  # a row wider than a block: each thread a strided part of it
            _, thread_x = sch.split(loops[-1], factors=[None, threads])
            sch.bind(thread_x, "threadIdx.x")
        else:
            sch.bind(loops[-1], "threadIdx.x")
        sch.bind(thread_y, "threadIdx.y")
        sch.bind(block_x, "blockIdx.x")
        if len(loops) > 2:
            sch.bind(sch.fuse(*loops[:-2]), "blockIdx.y")
        return sch

    @staticmethod
    def _threads(extents: list, max_threads: int) -> int | None:
        """The threads of one row (``_threads_per_row``) when the loops fit the rule, else
        None."""
        if len(extents) < 2:
            return None
        width, rows = extents[-1], extents[-2]
        if not isinstance(width, tirx.IntImm) or isinstance(rows, tirx.IntImm) or \
                int(width) < MIN_WIDTH or not outer_loops_fit_grid_y(extents[:-2]):
            return None
        return _threads_per_row(int(width), max_threads)


def _threads_per_row(width: int, max_threads: int) -> int | None:
    """The threads of one row: the whole row up to a block's threads; above, the largest
    multiple of 32 within a block that divides it (each thread then writes width / threads
    elements, a warp's 32 neighbours at a time); None for a row no such count divides."""
    if width <= max_threads:
        return width if width % 32 == 0 else None
    for threads in range(max_threads - max_threads % 32, 0, -32):
        if width % threads == 0:
            return threads
    return None


def symbolic_below_the_batch(extents: list) -> bool:
    """Whether a loop below the outermost has a symbolic extent: rows of a sequence (a
    prefill's tokens, audio frames), many of them, not rows of a batch alone (a decode
    step's), too few to fill the GPU one block or warp a row."""
    return any(not isinstance(extent, tirx.IntImm) for extent in extents[1:])


def outer_loops_fit_grid_y(outer: list) -> bool:
    """Whether the loops above the rows may be fused into blockIdx.y: their indices then
    divide by the extents below the outermost, which must be static, and the whole must
    stay within gridDim.y's limit."""
    if not all(isinstance(e, tirx.IntImm) for e in outer[1:]):
        return False
    static = 1
    for extent in outer[1:]:
        static *= int(extent)
    if outer and not isinstance(outer[0], tirx.IntImm):
        return static <= MAX_STATIC_UNDER_BATCH
    return static * (int(outer[0]) if outer else 1) <= MAX_GRID_Y


@dataclass(frozen=True)
class InjectiveLoops:
    """An injective PrimFunc's schedule with its one spatial block's loops and their extents."""

    sch: s_tir.Schedule
    loops: list
    extents: list


def injective_loops(rule: GPUScheduleRule, func, target: Target) -> InjectiveLoops | None:
    """The loops of an injective PrimFunc of one spatial block (after inlining) that
    ``rule`` may schedule for ``target``, or None."""
    if not isinstance(func, tirx.PrimFunc) or not rule.is_target_available(target):
        return None
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos is None:
        return None
    infos = try_inline(sch, infos)
    if len(infos) != 1 or any(kind != "S" for kind in infos[0].dom_kind()):
        return None
    loops = sch.get_loops(infos[0].block_rv)
    return InjectiveLoops(sch, loops, [sch.get(loop).extent for loop in loops])
