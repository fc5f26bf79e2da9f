"""A GPU schedule rule for reductions to one element, which dlight leaves on the host."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import SBlockInfo, normalize_prim_func
from tvm.s_tir.dlight.base import (ScheduleRule, max_threads_per_block,
                                   try_inline_contiguous_spatial)
from tvm.sym import Analyzer

# One thread block does the whole reduction: as many threads as a block can have (dlight's
# Reduction takes the same for a sum to a scalar), so that the one SM has as many loads in
# flight as it can.
MAX_THREADS = 1024

# The combiners TVM's LowerCrossThreadReduction turns into an all-reduce across threads.
_COMBINERS = (tirx.Add, tirx.Mul, tirx.Max, tirx.Min)


def _is_one(analyzer: Analyzer, extent) -> bool:
    return analyzer.can_prove_equal(extent, 1)


def _combines_into_itself(block: s_tir.SBlock) -> bool:
    """``out[i] = op(out[i], value)`` (or ``op(value, out[i])``) with ``op`` a combiner
    above and one output: what the cross-thread lowering recognizes."""
    store = block.body
    if block.init is None or len(block.writes) != 1 or not isinstance(store, tirx.BufferStore):
        return False
    if not isinstance(store.value, _COMBINERS):
        return False
    own = tirx.BufferLoad(store.buffer, store.indices)
    return any(tvm_ffi.structural_equal(side, own) for side in (store.value.a, store.value.b))


def _one_element(analyzer: Analyzer, info: SBlockInfo) -> bool:
    """Every spatial iterator of the block has extent 1: it writes one element."""
    return all(_is_one(analyzer, it.dom) for it in info.iters if it.kind == "S")


class FullReduction(ScheduleRule):
    """Reductions to one element (a full sum, mean, max or min, with or without keepdims):
    one thread block, the reduction loops fused over its threads, an all-reduce across them.

    TVM 0.27's dlight passes a full reduction over a symbolic dim from ``Reduction`` (an
    internal check in ``rfactor`` on a mean; a max or min is not a sum) to
    ``GeneralReduction``, whose scalar-output path binds a unit loop *under* the reduction
    loops: they stay on the host, which launches a one-thread kernel per element (n * 512
    launches for the mean of an (n, 512) tensor; CheckDeviceKernels refuses it). A full max
    over a static extent reaches ``Fallback``: one thread does it all.

    Before (``mean(h) > thr``, h: (n, 512), legalized and fused; normalization gives
    the reduction a unit spatial loop)::

        for ax0, k0, k1 in T.grid(1, n, 512):
            with T.sblock("h_red"):                                   # "SRR"
                h_red[()] = h_red[()] + h[k0, k1]
        with T.sblock("T_greater"):                                   # the epilogue
            out[()] = thr[()] < h_red[()] / T.Cast("float32", T.max(n * 512, 1))

    After: one block; each thread reduces every 1024th element (coalesced), TVM's
    LowerCrossThreadReduction adds the threads' accumulators (each starts at the reducer's
    identity, so over n = 0 the result is the identity: 0, or -inf for grape's max whose
    legalization selects it), thread 0 computes the epilogue::

        for u in T.thread_binding(1, thread="blockIdx.x"):
            for ax0 in range(1):
                for k_1 in T.thread_binding(1024, thread="threadIdx.x"):
                    for k_0 in range(T.ceildiv(n * 512, 1024)):
                        with T.sblock("h_red"):                       # a cross-thread reduction
                            T.where(k_0 * 1024 + k_1 < n * 512)
                            k = k_0 * 1024 + k_1
                            h_red_shared[()] = h_red_shared[()] + h[k // 512, k % 512]
            for u_1 in T.thread_binding(1024, thread="threadIdx.x"):
                with T.sblock("T_greater"):
                    T.where(u_1 < 1)                                  # thread 0
                    out[()] = thr[()] < h_red_shared[()] / T.Cast("float32", T.max(n * 512, 1))

    A chain of such reductions (a variance: the mean, then the sum of squared deviations)
    runs in the same block, each intermediate in shared memory. Not taken: anything with a
    block of more than one output element. A few rows (a max over (4, n) along n) are
    dlight's ``GeneralReduction``'s: it gives each row a thread block already.
    """

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, _: bool):
        if not isinstance(func, tirx.PrimFunc) or "gpu" not in target.keys:
            return None
        sch = s_tir.Schedule(func)
        infos = try_inline_contiguous_spatial(sch, normalize_prim_func(sch))
        if not infos or not self._mine(sch, infos):
            return None
        len_tx = self._threads(infos, target)
        last, *firsts = reversed(infos)
        bx = self._bind_last(sch, last, len_tx)
        for info in firsts:  # the blocks before the last one, from the last back
            block = info.block_rv
            # The threads of a later block read this result: it lives in shared memory.
            for i, _ in enumerate(sch.get(block).writes):
                sch.set_scope(block, buffer_index=i, storage_scope="shared")
            sch.compute_at(block, bx, preserve_unit_loops=True)
            # compute_at made one loop per block iterator under bx, in the iterators' order.
            loops = sch.get_loops(block)[1:]
            iters = sch.get(block).iter_vars
            if len(loops) != len(iters):
                return None
            self._bind_threads(sch, block, [loop for loop, it in zip(loops, iters)
                                            if it.iter_type == tirx.IterVar.CommReduce], len_tx)
        return sch

    @staticmethod
    def _mine(sch: s_tir.Schedule, infos: list[SBlockInfo]) -> bool:
        """Reductions to one element, and element-wise blocks on one element after them."""
        analyzer = Analyzer()
        if not infos[0].is_reduction():
            return False
        for info in infos:
            if not _one_element(analyzer, info):
                return False
            if info.is_reduction():
                if set(info.dom_kind()) - {"S", "R"} or \
                        not _combines_into_itself(sch.get(info.block_rv)):
                    return False
            elif not info.is_injective():
                return False
        return True

    @staticmethod
    def _threads(infos: list[SBlockInfo], target: tvm.target.Target) -> int:
        """MAX_THREADS (no more than the target allows); for a static extent the smallest
        power of two, at least a warp, that covers the largest reduction."""
        limit = min(MAX_THREADS, max_threads_per_block(target))
        largest = 1
        for info in infos:
            extent = 1
            for it in info.iters:
                if it.kind == "R":
                    extent = extent * it.dom
            extent = Analyzer().simplify(extent)
            if not isinstance(extent, tirx.IntImm):
                return limit
            largest = max(largest, extent.value)
        threads = 32
        while threads < largest and threads < limit:
            threads *= 2
        return min(threads, limit)

    @staticmethod
    def _bind_last(sch: s_tir.Schedule, info: SBlockInfo, len_tx: int):
        """The last block: its unit spatial loops become the one ``blockIdx.x``, the rest
        goes over the threads (a last block that is not a reduction: thread 0)."""
        block = info.block_rv
        s_loops = [it.loop_rv for it in info.iters if it.kind == "S"]
        r_loops = [it.loop_rv for it in info.iters if it.kind == "R"]
        if not s_loops:
            s_loops = [sch.add_unit_loop(block)]
        sch.reorder(*s_loops, *r_loops)
        bx = sch.fuse(*s_loops)
        sch.bind(bx, "blockIdx.x")
        FullReduction._bind_threads(sch, block, r_loops, len_tx)
        return bx

    @staticmethod
    def _bind_threads(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, r_loops: list,
                      len_tx: int):
        """Fuse the block's reduction loops and split them over ``len_tx`` threads,
        thread-minor: consecutive threads read consecutive elements. A block with none
        gets a unit loop instead: thread 0 computes it."""
        loop = sch.fuse(*r_loops) if r_loops else sch.add_unit_loop(block)
        serial, tx = sch.split(loop, factors=[None, len_tx])
        sch.reorder(tx, serial)
        sch.bind(tx, "threadIdx.x")
        sch.annotate(serial, ann_key="pragma_auto_unroll_max_step", ann_val=256)
        sch.annotate(serial, ann_key="pragma_unroll_explicit", ann_val=1)

    def __repr__(self) -> str:
        return "FullReduction()"
