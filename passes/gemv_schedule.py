"""A GPU schedule for matmuls whose rows are few (decode): ``y[m, n] = f(sum_k x[m, k] w[k, n])``.

dlight (TVM 0.27) has none that fits a decode step with a symbolic batch: its ``GEMV`` rule
never matches when the row count M is symbolic (both ``x[m, k]`` and ``w[k, n]`` look like
the vector), and ``LowBatchGEMV``'s schedule of weights laid out ``[K, N]`` (Hugging Face
GPT-2's Conv1D, the benchmark models) leaves loops outside the threads, which run on the
host (``unbound_kernels`` flags it; ``[N, K]`` it binds fully). Matmul's schedule,
which then takes such a kernel, tiles M by 32 or more rows and runs at a fraction of the
memory bandwidth when M is 1.

``DecodeGemv`` takes a PrimFunc whose one reduction is a matmul with static K and N, weights
``[K, N]`` or ``[N, K]`` (``nn.Linear``), rows M from one symbolic dim (or static and small),
and an optional elementwise epilogue (bias, GELU, residual add: whatever FuseOps put after it,
fused in the same kernel). Each thread block computes MB rows by NT columns:

- phase 1: each thread sums its share of K for every one of the MB rows, loading each weight
  once (16-byte vector loads along the contiguous axis) and reusing it for every row: the
  rows are a loop inside the thread, x read from L1;
- phase 2: the partial sums go through shared memory (one barrier), and each output is the
  sum of its partials, then the epilogue, then one store.

blockIdx.y walks M in tiles of MB rows, so each kernel is correct for any M; it is fast only
for M up to about MB. With M symbolic the PrimFunc becomes a host-side dispatch: ``if M <= 1``
the MB=1 kernel, ``elif M <= 2`` ... ``else`` dlight's Matmul schedule of the same function
(``CudaCoreMatmul``): one kernel per bucket, each with fixed block dims, so a region has at
most ``len(buckets) + 1`` launch configurations from its matmuls over any range of M.

fp16 (any float other than fp32) accumulates in fp32, in both the GEMV kernels and the large-M
kernel, as PyTorch does: the sum is kept in an fp32 buffer and cast once, before the epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import ScheduleRule, try_inline_contiguous_spatial
from tvm_ffi.structural import structural_map, structural_walk

from .dependent_launch import WEIGHTS_FIRST

BUCKETS = (1, 2, 4, 8)
GEMV_MARK = "grape_gemv_rows"  # block annotation: a GEMV kernel's partial sums, rows of M a block
# The most of a thread's share of the weights held in registers (``weights_first``): 64
# 32-bit registers; GPT-2's layers need 12 to 48 in fp32 (48 for the MLP down projection,
# K = 3072: 64 threads along K, one row a thread).
WEIGHT_REGISTER_BYTES = 256
# Whether a one-row GEMV that computes a row norm's statistics first loads its weights before
# them too (``_weights_first_in_block``); off, it waits first (the A/B build of
# bench/gpu/build_artifacts.py's decode_variants).
WEIGHTS_BEFORE_NORM = True


@dataclass(frozen=True)
class GemvShape:
    """What ``match_gemv`` found in a PrimFunc."""

    block: str  # the reduction block's name
    rows: tirx.Expr  # M: the extent of the one non-unit row iter (1 when there is none)
    k: int
    n: int
    layout: str  # "kn": w[k, n] (reduction outer); "nk": w[n, k] (reduction inner)
    dtype: str  # of x and w
    acc_dtype: str  # of the reduction's output

    @property
    def symbolic(self) -> bool:
        return not isinstance(self.rows, tirx.IntImm)


def _iter_var_index(indices, iter_vars) -> list[int] | None:
    """Which block iter each index is, constant indices (a unit dim) left out; None when an
    index is neither a plain iter var nor a constant."""
    positions = []
    for index in indices:
        if isinstance(index, tirx.IntImm):
            continue
        match = [i for i, iv in enumerate(iter_vars) if index.same_as(iv.var)]
        if len(match) != 1:
            return None
        positions.append(match[0])
    return positions


def _same_index(a, b) -> bool:
    if isinstance(a, tirx.IntImm) and isinstance(b, tirx.IntImm):
        return int(a) == int(b)
    return a.same_as(b)


def _reduction_update(block) -> tuple | None:
    """``C[idx] = C[idx] + a * b`` (casts allowed on a and b): (store, a, b), else None."""
    store = block.body
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Add):
        return None
    lhs, rhs = store.value.a, store.value.b
    if not (isinstance(lhs, TensorLoad) and lhs.source.same_as(store.buffer)
            and len(lhs.indices) == len(store.indices)
            and all(_same_index(a, b) for a, b in zip(lhs.indices, store.indices))):
        return None
    if not isinstance(rhs, tirx.Mul):
        return None
    return store, rhs.a, rhs.b


def _load_of(expr):
    while isinstance(expr, tirx.Cast):
        expr = expr.value
    return expr if isinstance(expr, TensorLoad) else None


def _static(expr) -> int | None:
    return int(expr) if isinstance(expr, tirx.IntImm) else None


@dataclass(frozen=True)
class _Operands:
    rows: list[int]  # positions of the row iters among the block's iters
    n: int
    k: int
    weight: TensorLoad
    vector: TensorLoad
    store: tirx.BufferStore
    layout: str


def _operands(block, kinds: list[str]) -> _Operands | None:
    """Where m.., n and k are in ``C[m.., n] += x[m.., k] * w[k, n]`` (or ``w[n, k]``)."""
    update = _reduction_update(block)
    if update is None or kinds.count("R") != 1:
        return None
    store, a, b = update
    loads = [_load_of(a), _load_of(b)]
    if None in loads or loads[0].source.same_as(loads[1].source):
        return None
    ivs = list(block.iter_vars)
    k_pos = kinds.index("R")
    out_pos = _iter_var_index(store.indices, ivs)
    if out_pos is None or not out_pos or k_pos in out_pos:
        return None
    n_pos = out_pos[-1]
    for weight, vector in (loads, loads[::-1]):
        w_pos = _iter_var_index(weight.indices, ivs)
        x_pos = _iter_var_index(vector.indices, ivs)
        if w_pos is None or x_pos is None or sorted(w_pos) != sorted([k_pos, n_pos]):
            continue
        if x_pos == out_pos[:-1] + [k_pos]:
            return _Operands(out_pos[:-1], n_pos, k_pos, weight, vector, store,
                             "kn" if w_pos == [k_pos, n_pos] else "nk")
    return None


def _elementwise_consumer(sch: s_tir.Schedule, epilogue, buffer) -> bool:
    """Whether ``epilogue`` reads ``buffer`` only at its own iters, in order (unit dims at a
    constant): one element per output, so each thread's epilogue reads only the sum that
    thread computed."""
    block = sch.get(epilogue)
    own = [iv.var for iv in block.iter_vars]
    regions = [r for r in block.reads if r.source.same_as(buffer)]

    def at_own_iters(region) -> bool:
        if any(_static(rng.extent) != 1 for rng in region.region):
            return False
        varying = [rng.min for rng in region.region if not isinstance(rng.min, tirx.IntImm)]
        return len(varying) == len(own) and all(a.same_as(b) for a, b in zip(varying, own))

    return bool(regions) and all(at_own_iters(r) for r in regions)


def match_gemv(func: tirx.PrimFunc) -> GemvShape | None:
    """The matmul ``DecodeGemv`` schedules in ``func``, or None.

    One reduction block ``C[m.., n] += x[m.., k] * w[k, n]`` (or ``w[n, k]``) and, once the
    spatial blocks are inlined, at most one more: an epilogue reading C elementwise. ``w``
    2-D with static K and N; x and w of one float dtype; the row iters (those of x and C
    besides k) all of extent 1 but at most one; every iter of one index dtype.
    """
    sch = s_tir.Schedule(func)
    infos = try_inline_contiguous_spatial(sch, normalize_prim_func(sch))
    if infos is None or not 1 <= len(infos) <= 2 or infos[0].is_injective():
        return None
    info = infos[0]
    block = sch.get(info.block_rv)
    found = _operands(block, [i.kind for i in info.iters])
    if found is None:
        return None
    if len(infos) == 2 and not (infos[1].is_injective() and _elementwise_consumer(
            sch, infos[1].block_rv, found.store.buffer)):
        return None
    ivs = list(block.iter_vars)
    if len({str(iv.var.ty) for iv in ivs}) > 1:
        # Iters of mixed int32/int64: TVM 0.27's cross-thread reduction then keeps one
        # thread's partial sum per output (wrong results on the GPU, no error).
        return None
    k, n = _static(ivs[found.k].dom.extent), _static(ivs[found.n].dom.extent)
    weight_shape = found.weight.source.shape
    if k is None or n is None or len(weight_shape) != 2 or None in map(_static, weight_shape):
        return None
    big_rows = [ivs[p].dom.extent for p in found.rows if _static(ivs[p].dom.extent) != 1]
    if len(big_rows) > 1:
        return None
    dtype = str(found.weight.source.dtype)
    if str(found.vector.source.dtype) != dtype or dtype not in ("float32", "float16", "bfloat16"):
        return None
    return GemvShape(block=block.name_hint, rows=big_rows[0] if big_rows else tirx.IntImm("int64", 1),
                     k=k, n=n, layout=found.layout, dtype=dtype,
                     acc_dtype=str(found.store.buffer.dtype))


def accumulate_in_fp32(func: tirx.PrimFunc, block_name: str) -> tirx.PrimFunc:
    """``func`` with its matmul summing into an fp32 buffer, cast once afterwards.

    Before::

        C[i, j] = C[i, j] + x[i, k] * w[k, j]            # fp16 sum

    After::

        C32[i, j] = C32[i, j] + f32(x[i, k]) * f32(w[k, j])
        C[i, j] = f16(C32[i, j])                         # a spatial block: the epilogue's first step
    """
    sch = s_tir.Schedule(func)
    block = sch.get_sblock(block_name)
    sch.cache_write(block, 0, "global")
    sch.unsafe_set_dtype(block, 0, "float32")
    # unsafe_set_dtype keeps the sum in the old dtype (f32(f16(C32) + x * w)): sum in fp32.
    c32 = sch.get(block).writes[0].source

    def widen(expr):
        return expr if str(expr.ty) == "float32" else tirx.Cast("float32", expr)

    def fix(store):
        if not store.buffer.same_as(c32) or not isinstance(store.value, tirx.Cast):
            return store
        inner = store.value.value
        if isinstance(inner, tirx.FloatImm):  # the init: f32(f16(0)), a constant reducers know
            return tirx.BufferStore(c32, tirx.FloatImm("float32", inner.value), store.indices)
        if not isinstance(inner, tirx.Add) or not isinstance(inner.b, tirx.Mul):
            return store
        acc = tirx.BufferLoad(c32, store.indices)
        product = tirx.Mul(widen(inner.b.a), widen(inner.b.b))
        return tirx.BufferStore(c32, tirx.Add(acc, product), store.indices)

    return structural_map(sch.mod["main"], (tirx.BufferStore, fix))



@dataclass(frozen=True)
class GemvConfig:
    """One GEMV kernel's tiling: a block computes ``rows`` x ``cols`` outputs with
    ``threads_k`` x ``threads_n`` threads; each thread sums K / threads_k of the reduction
    in ``unroll``-step chunks, loading ``vec`` contiguous weights at a time."""

    rows: int  # MB: rows of M per block (blockIdx.y walks M in these tiles)
    vec: int  # weights per vector load (16 bytes, or 1 where the contiguous axis is odd)
    threads_k: int  # threads splitting K (summed in phase 2)
    threads_n: int  # threads splitting the block's columns
    per_thread_n: int  # columns per thread: vec for "kn", rows of w for "nk"
    unroll: int  # k-steps whose weight loads are issued together

    @property
    def cols(self) -> int:
        return self.threads_n * self.per_thread_n

    @property
    def threads(self) -> int:
        return self.threads_k * self.threads_n

    @property
    def group(self) -> int:
        """Threads that sum one output's partials in phase 2 (threadIdx.x's extent)."""
        return max(1, self.threads // (self.rows * self.cols))


# Tuning targets (performance only; any value gives correct kernels): blocks wanted per
# kernel (about two per SM on a 132-SM H200) and the shared memory the partial sums may use.
TARGET_BLOCKS = 256
PARTIALS_BYTES = 32 * 1024
SPLIT_ROWS_ABOVE = 4  # buckets of more rows may spread them over blocks (rows_per_block)


def rows_per_block(rows: int, column_blocks: int) -> int:
    """Rows of M a block of an fp32 [N, K]-weight kernel takes for a bucket of ``rows``, with
    ``column_blocks`` blocks along N: above ``SPLIT_ROWS_ABOVE`` rows, halved (to 2 at least)
    while the grid is short of ``TARGET_BLOCKS``.

    Each weight load of a block serves its rows, each row a load of x: at 8 rows the x loads
    outnumber the weight loads 8 to 1. On the H200 (bench/results/gemv_configs.json, fp32,
    M = 8, in a CUDA graph), K = 1024, N = 256 took 2.30 us at 2 rows a block against 3.27
    at 8, GPT-2's K = 3072, N = 768 5.71 at 4 against 6.30 (weights in the L2; 7.68 against
    8.60 read from HBM), and shapes whose grid was full already were as fast or faster at 8.
    At 4 rows and fewer, halving was as often slower as faster.
    """
    if rows <= SPLIT_ROWS_ABOVE:
        return rows
    per_block = rows
    while per_block > 2 and column_blocks * (rows // per_block) < TARGET_BLOCKS:
        per_block //= 2
    return per_block


def _largest_dividing(n: int, options) -> int:
    return next((o for o in options if n % o == 0), 1)


def gemv_config(shape: GemvShape, bucket: int) -> GemvConfig:
    """The tiling for ``shape`` in the bucket of up to ``bucket`` rows of M: that many rows
    per block, or fewer where the grid would be short (``rows_per_block``)."""
    rows = bucket  # per block
    size = tvm.DataType(shape.dtype).bits // 8
    full = 16 // size
    if shape.layout == "kn":  # w[k, n]: vectors along n, threads_n lanes side by side
        vec = full if shape.n % full == 0 else 1
        lanes = (8, 4, 2) if vec > 1 else (32, 16, 8)
        # the widest rows of w per block (most bytes per row) that still give enough blocks
        threads_n = next((t for t in lanes if -(-shape.n // (t * vec)) >= TARGET_BLOCKS), lanes[-1])
        per_thread_n = vec
        # fewer blocks than about one per SM (N = 768): more threads each, more loads in flight
        threads = 512 if -(-shape.n // (threads_n * vec)) < TARGET_BLOCKS // 2 else 256
        threads_k = _largest_dividing(shape.k, tuple(t // threads_n for t in (threads, 256, 128, 64, 32)
                                                     if t >= threads_n) + (8, 4, 2, 1))
    else:  # w[n, k]: vectors along k, threads_k lanes side by side in a row
        vec = full if shape.k % full == 0 else 1
        threads_k = _largest_dividing(shape.k // vec, (64, 32, 16, 8, 4, 2, 1))
        threads_n = max(1, 256 // threads_k)
        per_thread_n = next((r for r in (4, 2) if -(-shape.n // (threads_n * r)) >= TARGET_BLOCKS), 1)
        if shape.dtype == "float32":  # measured in fp32 only (rows_per_block)
            rows = rows_per_block(bucket, -(-shape.n // (threads_n * per_thread_n)))
    while threads_k > 1 and threads_k * rows * threads_n * per_thread_n * 4 > PARTIALS_BYTES:
        threads_k //= 2
    steps = shape.k // (threads_k * (vec if shape.layout == "nk" else 1))
    unroll = _largest_dividing(steps, (8, 6, 4, 3, 2, 1) if shape.layout == "kn" else (4, 3, 2, 1))
    return GemvConfig(rows, vec, threads_k, threads_n, per_thread_n, unroll)



def _matmul_block(sch: s_tir.Schedule, name: str, keep: tuple[str, ...] = ()):
    """The matmul block (normalized, epilogue inlined into one block) with the loops of its
    iters, and its operands; the spatial blocks named in ``keep`` are not inlined."""
    infos = [i for i in normalize_prim_func(sch) if sch.get(i.block_rv).name_hint not in keep]
    infos = try_inline_contiguous_spatial(sch, infos)
    info = next(i for i in infos if sch.get(i.block_rv).name_hint == name)
    return info, _operands(sch.get(info.block_rv), [i.kind for i in info.iters])


def schedule_gemv(func: tirx.PrimFunc, shape: GemvShape, config: GemvConfig,
                  prologue: bool = False) -> s_tir.Schedule:
    """Schedule ``func`` (matched by ``match_gemv``, fp32 sums) as one GEMV kernel.

    Loop nest for "kn" (w[k, n]); "nk" (w[n, k]) loads 16 bytes along k, x's chunk too,
    and each thread sums ``per_thread_n`` rows of w::

        blockIdx.y: M / rows, blockIdx.x: N / cols; threads: (tk, tn), tn fastest
          acc[rows][vec] = 0                                  registers
          for ko in K / (threads_k * unroll):
            w_reg[unroll][vec] = w[k.., n..]                  16-byte loads, issued together
            for u, m, v (unrolled): acc[m][v] += x[m, k] * w_reg[u][v]
          partial[tk][m][n] = acc                             shared, rows padded by one word
          __syncthreads
          output o = (m, n) of the tile: thread row threadIdx.y == o, its `group` lanes
            (threadIdx.x) each sum threads_k / group partials, then a warp-shuffle sum
          lane 0: y[m, n] = epilogue(sum, bias[n], ...)       one store per output

    Every loop is bound to (threadIdx.y, threadIdx.x) = (threads / group, group) with the
    same extents throughout (TVM unifies bindings of one thread axis without checking their
    extents) and no split leaves a remainder: rows beyond M and columns beyond N are summed
    on zeros (``pad_einsum``) and never stored, so no block has a predicate that
    ``reverse_compute_at`` would not see.

    ``prologue`` (one row a block): ``func`` computes x first, a row norm's output
    (``few_rows_gemv``'s ``compose_after``): its reductions over the row run in every block,
    before phase 1 (``_row_stats_in_block``), and x is normalized as it is read::

        stats = sum_k f(x[m, k], stats before)          shared; every thread a share of k
        ... x_reg[k..] = norm(x[m, k..], stats, gamma[k..], beta[k..])

    Where a thread's share of the weights fits its registers (``weights_first``) it is
    loaded first, before phase 1 (``_weights_in_registers``), or before a prologue's
    statistics (``_weights_first_in_block``).
    """
    sch = s_tir.Schedule(func)
    # a row norm before the matmul: its output block, kept until x's registers (or padding
    # block) exist, then inlined into them
    normed = sch.get_producers(sch.get_sblock(shape.block)) if prologue else []
    if prologue and (len(normed) != 1 or config.rows != 1):
        raise ValueError("a prologue is one block writing x, for one row a GEMV block")
    keep = tuple(sch.get(b).name_hint for b in normed)
    info, found = _matmul_block(sch, shape.block, keep)
    c = config
    iters = sch.get(info.block_rv).iter_vars
    n_extent = int(iters[found.n].dom.extent)
    rows_padded = c.rows if shape.symbolic or int(shape.rows) % c.rows else 1
    cols_padded = c.cols if n_extent % c.cols else 1
    padding = [1] * len(iters)
    for p in found.rows:
        if _static(iters[p].dom.extent) != 1:
            padding[p] = rows_padded
    padding[found.n] = cols_padded
    pads = {}  # operand -> its padding block (zero outside the operand), where padded
    if any(p > 1 for p in padding):
        sch.pad_einsum(info.block_rv, padding)
        mm = sch.get_sblock(shape.block)
        for producer in sch.get_producers(mm):  # x_pad, w_pad: zero outside x and w
            source = sch.get(producer).reads[0].source
            pads["x" if source.same_as(found.vector.source) else "w"] = producer
        for consumer in sch.get_consumers(mm):  # the copy out of the padded sum
            if sch.get_consumers(consumer):
                sch.compute_inline(consumer)
        # the same iters, padded (blocks looked up again: the schedule's analysis is redone)
        info = next(i for i in normalize_prim_func(sch)
                    if sch.get(i.block_rv).name_hint == shape.block)
        pads = {k: sch.get_sblock(sch.get(v).name_hint) for k, v in pads.items()}
    mm = info.block_rv
    epilogues = sch.get_consumers(mm)
    if not epilogues:  # the sum is the output: a copy out of registers writes it
        epilogue = sch.cache_write(mm, 0, "local")
    else:
        (epilogue,) = epilogues
    loops = [i.loop_rv for i in info.iters]
    n, k = loops[found.n], loops[found.k]
    if found.rows:
        m = sch.fuse(*[loops[p] for p in found.rows])
    else:  # one row, its unit dims normalized away: a loop of extent 1 stands for it
        m = sch.add_unit_loop(info.block_rv)
        sch.reorder(m, n, k)
    mo, mi = sch.split(m, [None, c.rows])
    bx, tn, vn = sch.split(n, [None, c.threads_n, c.per_thread_n])
    if shape.layout == "kn":
        # k = (ko * threads_k + tk) * unroll + ku: a thread's `unroll` rows of w are adjacent
        ko, tk, ku = sch.split(k, [None, c.threads_k, c.unroll])
        sch.reorder(mo, bx, tk, tn, ko, ku, mi, vn)
    else:
        # k = ((ko * unroll + ku) * threads_k + tk) * vec + kv: lanes side by side along k
        ko, ku, tk, kv = sch.split(k, [None, c.unroll, c.threads_k, c.vec])
        sch.reorder(mo, bx, tn, tk, ko, ku, mi, vn, kv)
    partial = sch.rfactor(tk, 0)
    sch.annotate(partial, GEMV_MARK, c.rows)  # which kernels are this rule's (tests, inspection)
    acc = sch.cache_write(partial, 0, "local")  # partial sums in registers ...
    # every loop of the kernel is bound to (threadIdx.y, threadIdx.x) = (threads / group, group)
    ty_extent, tx_extent = c.threads // c.group, c.group
    if shape.layout == "kn":
        mo, bx, tk, tn, ko, ku, mi, vn = sch.get_loops(partial)
        threads = sch.fuse(tk, tn)  # tn fastest: a warp reads whole 32-byte rows of w
        inner = (ku, mi, vn)
    else:
        mo, bx, tn, tk, ko, ku, mi, vn, kv = sch.get_loops(partial)
        threads = sch.fuse(tn, tk)  # tk fastest: a warp reads 512 contiguous bytes of a row
        inner = (ku, mi, vn, kv)
    ty, tx = sch.split(threads, [ty_extent, tx_extent])
    sch.bind(mo, "blockIdx.y")
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.reverse_compute_at(acc, tx, preserve_unit_loops=True)  # ... to shared memory once
    sch.set_scope(acc, 0, "shared")
    sch.storage_align(acc, 0, axis=0, factor=32, offset=1)
    # Registers: the weights of `unroll` k-steps ("kn"; "nk": of one k-step), loaded as
    # vectors; for "nk" also x's chunk of each row. A padded operand's padding block is its
    # cache (it holds the zeros); x is read straight from L1 for "kn".
    cached = {"w": ko if shape.layout == "kn" else ku}
    if shape.layout == "nk":
        cached["x"] = ku
    elif "x" in pads:
        sch.compute_inline(pads.pop("x"))
    if weights_first(shape, c) and "w" not in pads and (WEIGHTS_BEFORE_NORM or not prologue):
        if prologue:  # first in the block, before the row statistics that read x
            _weights_first_in_block(sch, partial, found.weight.source, bx, c)
        else:
            _weights_in_registers(sch, partial, found.weight.source, tx)
        del cached["w"]
        sch.unroll(ko)
    for operand, loop in cached.items():
        if operand in pads:
            reg = pads[operand]
            sch.set_scope(reg, 0, "local")
        else:
            buffer = (found.weight if operand == "w" else found.vector).source
            index = next(i for i, r in enumerate(sch.get(partial).reads) if r.source.same_as(buffer))
            reg = sch.cache_read(partial, index, "local")
        sch.compute_at(reg, loop, preserve_unit_loops=True)
        lanes = sch.get_loops(reg)[-1]
        if prologue and operand == "x" and c.vec > 4:
            # x normalized in fp32 as it is read: TVM's CUDA codegen has no 8-lane fp32
            # vectors (16-bit x, 16-byte loads), so 4 lanes at a time
            outer, lanes = sch.split(lanes, [None, 4])
            sch.unroll(outer)
        sch.vectorize(lanes)
    sch.decompose_reduction(partial, ko)
    for loop in inner:
        sch.unroll(loop)
    if prologue:
        _row_stats_in_block(sch, keep[0], bx, ty_extent, tx_extent)
    # phase 2: output o of the tile is summed by the `group` threads of threadIdx.y == o
    # (each sums threads_k / group partials, then a cross-thread sum over threadIdx.x)
    sch.reverse_compute_at(mm, bx, preserve_unit_loops=True)
    r_loop, *spatial = sch.get_loops(mm)[2:]
    outputs = sch.fuse(*spatial)
    o_thread = outputs
    loops = [o_thread]
    if c.group > 1:  # tk = serial * group + lane: lanes read adjacent rows of the partials
        r_serial, r_thread = sch.split(r_loop, [None, c.group])
        loops.append(r_thread)
        sch.bind(r_thread, "threadIdx.x")
    else:
        r_serial = r_loop
    if c.rows * c.cols > ty_extent:  # more outputs than thread rows: a few each, in turn
        o_serial, o_thread = sch.split(outputs, [None, ty_extent])
        sch.reorder(o_serial, o_thread, *loops[1:], r_serial)
    else:
        o_thread = outputs
        sch.reorder(o_thread, *loops[1:], r_serial)
    sch.bind(o_thread, "threadIdx.y")
    sch.set_scope(mm, 0, "local")
    # the epilogue: each output once, by the thread row that summed it
    sch.reverse_compute_at(epilogue, o_thread, preserve_unit_loops=True)
    return sch


def weights_first(shape: GemvShape, config: GemvConfig) -> bool:
    """Whether a kernel of ``config`` loads its thread's whole share of the weights into
    registers before anything else (``_weights_in_registers``, or
    ``_weights_first_in_block`` before a row norm's statistics): weights ``[N, K]``, at
    most ``WEIGHT_REGISTER_BYTES`` a thread."""
    if shape.layout != "nk":
        return False
    size = tvm.DataType(shape.dtype).bits // 8
    return config.per_thread_n * (shape.k // config.threads_k) * size <= WEIGHT_REGISTER_BYTES


def _weights_cache(sch: s_tir.Schedule, partial, weight: tirx.Buffer):
    """The register cache of the thread's share of the weights (``per_thread_n`` rows,
    K / threads_k of each), marked ``WEIGHTS_FIRST``: ``ProgrammaticDependentLaunch`` puts
    the kernel's wait after it, so the loads are in flight while the kernel waits for the
    kernel before it. Indexed by (n, k lane, k-step, unrolled step, element of the vector),
    of which a thread touches ``per_thread_n`` rows and one k lane: TVM keeps that much, in
    registers, where ``cache_read``'s region would span the strided k of the whole row."""
    block = sch.get(partial)
    index = next(i for i, r in enumerate(block.reads) if r.source.same_as(weight))
    # partial's iters: (tk, row of M, n, ko, ku, kv); one static row has none of M's
    if len(block.iter_vars) == 6:
        reg = sch.reindex_cache_read(partial, index, "local",
                                     lambda tk, m, n, ko, ku, kv: (n, tk, ko, ku, kv))
    else:
        reg = sch.reindex_cache_read(partial, index, "local",
                                     lambda tk, n, ko, ku, kv: (n, tk, ko, ku, kv))
    sch.annotate(reg, WEIGHTS_FIRST, 1)
    return reg


def _weights_in_registers(sch: s_tir.Schedule, partial, weight: tirx.Buffer, thread) -> None:
    """The weights' register cache (``_weights_cache``) loaded first under the partial
    sums' ``thread`` loop, as 16-byte vectors, then summed from there."""
    reg = _weights_cache(sch, partial, weight)
    sch.compute_at(reg, thread, preserve_unit_loops=True)
    *outer, lanes = sch.get_loops(reg)[4:]  # below blockIdx.y/x, threadIdx.y/x
    for loop in outer:
        sch.unroll(loop)
    sch.vectorize(lanes)


def _weights_first_in_block(sch: s_tir.Schedule, partial, weight: tirx.Buffer, bx,
                            config: GemvConfig) -> None:
    """The weights' register cache (``_weights_cache``) loaded first in the block (under
    ``bx``), before a row norm's statistics, which read x and so come after the wait: its
    loops bound to the threads as the partial sums' are, each thread loading the share it
    sums. One row a block (the prologue's)::

        blockIdx.x:
          threads (tn, tk): w_reg[vn][ko][ku][kv] = w[n.., k..]    16-byte loads
          (the wait)
          stats = ...                                               the row's statistics
          threads (tn, tk): acc += norm(x[k..]) * w_reg[..]
    """
    c = config
    reg = _weights_cache(sch, partial, weight)
    sch.compute_at(reg, bx, preserve_unit_loops=True)
    loops = sch.get_loops(reg)[2:]  # below blockIdx.y/x: (tk, n, ko, ku, kv), the row's unit dropped
    extents = [_static(sch.get(loop).extent) for loop in loops]
    if len(loops) != 5 or extents[:2] != [c.threads_k, c.cols]:
        raise ValueError(f"the weights' cache has loops of extents {extents}, expected "
                         f"(threads_k {c.threads_k}, cols {c.cols}, k-steps, unroll, vector)")
    tk, n, ko, ku, kv = loops
    tn, vn = sch.split(n, [c.threads_n, c.per_thread_n])
    sch.reorder(tn, tk, ko, ku, vn, kv)
    ty, tx = sch.split(sch.fuse(tn, tk), [c.threads // c.group, c.group])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    for loop in (ko, ku, vn):
        sch.unroll(loop)
    sch.vectorize(kv)


def _row_stats_in_block(sch: s_tir.Schedule, normed: str, bx, ty_extent: int,
                        tx_extent: int) -> None:
    """A row norm's output block inlined into the matmul's reads of x, and its row
    reductions computed by each GEMV block for its one row: every thread takes a strided
    share of the row, summed across the block (TVM's cross-thread reduction), into shared
    memory."""
    block = sch.get_sblock(normed)
    stats = [b for b in sch.get_producers(block) if sch.get(b).name_hint != normed]
    sch.compute_inline(block)
    order = []
    while stats:  # the last reduction first: compute_at needs its consumers placed
        last = next(b for b in stats if not any(
            sch.get(c).name_hint in {sch.get(s).name_hint for s in stats}
            for c in sch.get_consumers(b)))
        stats = [b for b in stats if not b.same_as(last)]
        order.append(last)
    for stat in order:
        sch.compute_at(stat, bx, preserve_unit_loops=True)
        *_, k = sch.get_loops(stat)
        _, ty, tx = sch.split(k, [None, ty_extent, tx_extent])
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        sch.set_scope(stat, 0, "shared")
        # one value: the block's row (its predicate, row < M, would size it by M otherwise)
        sch.transform_layout(stat, ("write", 0), lambda *row: [tirx.IntImm("int64", 0)],
                             assume_injective_transform=True)


def dispatch_on_rows(func: tirx.PrimFunc, rows: tirx.Expr,
                     kernels: list[tuple[int, tirx.PrimFunc]], default: tirx.PrimFunc) -> tirx.PrimFunc:
    """One PrimFunc launching ``kernels[i]`` when ``rows <= bound_i`` (first match), else
    ``default``: the choice is made on the host, each branch launches its own kernel.

    ``func`` and every branch share parameters (all are schedules of ``func``)::

        if rows <= 1:   <kernel of rows 1>
        elif rows <= 2: <kernel of rows 2>
        ...
        else:           <default kernel>
    """
    body = default.body
    for bound, kernel in reversed(kernels):
        # thread invariant: the kernels' barriers may sit under this (host-side) condition
        condition = tirx.op.tvm_thread_invariant(rows <= tirx.IntImm(rows.ty, bound))
        body = tirx.IfThenElse(condition, kernel.body, body)
    root = s_tir.SBlock([], [], [], "root", body)
    return func.with_body(s_tir.SBlockRealize([], True, root))


def lowers_to_static_kernels(func: tirx.PrimFunc, target: tvm.target.Target) -> bool:
    """Whether TVM's TIR lowering of ``func`` gives kernels whose buffers all have static
    sizes: CUDA codegen refuses any other (a schedule whose regions TVM could not bound
    would fail the whole build there, after the rules have run)."""
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    mod = tvm.tirx.transform.BindTarget(target.with_host(tvm.target.Target("llvm")))(mod)
    pipeline, _, _ = tvm.tirx.get_default_tir_pipeline(target)
    dynamic = []

    def on_alloc(stmt):
        if not all(isinstance(d, tirx.IntImm) for d in stmt.buffer.shape):
            dynamic.append(stmt)

    for gvar, lowered in pipeline(mod).functions_items():
        if gvar.name_hint != "main":  # a kernel
            structural_walk(lowered.body, ((tirx.AllocBuffer, on_alloc),))
    return not dynamic


def gemv_by_rows(func: tirx.PrimFunc, shape: GemvShape, buckets: tuple[int, ...],
                 target: tvm.target.Target, default: tirx.PrimFunc | None = None,
                 before: tuple = (), kernel=None) -> tirx.PrimFunc | None:
    """``func`` (matched as ``shape``, summing in fp32) as GEMV kernels by buckets of M.

    M static: the kernel of its bucket (None where M is 0 or above the last bucket). M
    symbolic: ``dispatch_on_rows`` over ``before`` (``(bound, PrimFunc)`` pairs tested
    first), one kernel per bucket, and ``default`` above the last; where ``default`` is None
    the last bucket's kernel takes every M above it (it is correct for any M, one
    blockIdx.y per tile of rows). None where TVM's lowering would leave a buffer of
    symbolic size in a kernel (CUDA codegen refuses it). ``kernel(bucket)``: the PrimFunc a
    bucket launches, with ``func``'s parameters (by default ``schedule_gemv`` of ``func``).
    """
    if kernel is None:
        def kernel(bucket: int) -> tirx.PrimFunc:
            return schedule_gemv(func, shape, gemv_config(shape, bucket)).mod["main"]

    if not shape.symbolic:
        rows = int(shape.rows)
        if not 1 <= rows <= buckets[-1]:
            return None
        scheduled = kernel(next(b for b in buckets if b >= rows))
    else:
        kernels = [(b, kernel(b)) for b in buckets]
        if default is None:
            kernels, default = kernels[:-1], kernels[-1][1]
        scheduled = dispatch_on_rows(func, shape.rows, [*before, *kernels], default)
    return scheduled if lowers_to_static_kernels(scheduled, target) else None


class DecodeGemv(ScheduleRule):
    """GEMV kernels for matmuls with few rows, by buckets of M, dispatched on the host.

    Takes what ``match_gemv`` matches on a CUDA target (``gemv_by_rows``). M static: one
    GEMV kernel when M is at most the largest bucket (else None: dlight's rules follow). M
    symbolic: one kernel per bucket and, above the largest, ``large`` (dlight's Matmul on
    CUDA cores); where ``large`` declines, the largest bucket's kernel.
    """

    def __init__(self, buckets: tuple[int, ...] = BUCKETS, large: ScheduleRule | None = None):
        if not buckets or any(b & (b - 1) or b < 1 for b in buckets):
            raise ValueError(f"buckets must be powers of two, got {buckets}")
        self.buckets = tuple(sorted(set(buckets)))
        if large is None:
            from .gpu_schedules import CudaCoreMatmul  # pylint: disable=import-outside-toplevel

            large = CudaCoreMatmul()
        self.large = large

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "cuda":
            return None
        shape = match_gemv(func)
        if shape is None or (not shape.symbolic and int(shape.rows) > self.buckets[-1]):
            return None
        if shape.acc_dtype != "float32":
            func = accumulate_in_fp32(func, shape.block)
        large = self.large.apply(func, target, tunable) if shape.symbolic else None
        if isinstance(large, list):
            large = large[0] if large else None
        scheduled = gemv_by_rows(func, shape, self.buckets, target,
                                 default=None if large is None else large.mod["main"])
        return None if scheduled is None else s_tir.Schedule(scheduled)

    def __repr__(self) -> str:
        return f"DecodeGemv(buckets={self.buckets})"
