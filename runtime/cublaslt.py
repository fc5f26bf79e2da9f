"""cuBLASLt matmuls for the functions ``passes.OffloadMatmul`` calls, captured into grape's graphs.

The compiler rewrites a matmul into ``R.call_dps_packed("grape.cublaslt.matmul...", ...)``
(``MATMUL_FUNCTIONS``: the name says the epilogue and whether the weight is transposed). TVM's
VM calls that function while a region is captured; it runs ``cublasLtMatmul`` on the stream
TVM is capturing (``tvm_ffi.get_raw_stream``), with the library state of the backend that is
capturing (``CublasLt.active``): its handle, its workspace (allocated before any capture:
cuBLASLt itself allocates nothing in one) and its algorithm choices. Outside grape's calls
(TVM's own VM on the library) a thread keeps its own state per device. The kernels cuBLASLt
launches are then nodes of the region's graph like any other, re-pointed and re-shaped by the
patch kernel (bench/results/probe_cublaslt.json showed both work for cuBLAS's kernels).

An algorithm is chosen once per bucket of M (the rows of the product: powers of two, so M =
1..1024 gives 11 buckets), by cuBLASLt's heuristic at the bucket's upper end (its best
candidate whose split-K parts each sum at least ``MIN_K_PER_SPLIT`` of K), and kept:
cuBLASLt's own first choice changes with M far more often (bench/results/probe_cublaslt.json),
and each change would be another graph topology. Each size is checked once against its
bucket's algorithm (``cublasLtMatmulAlgoCheck``): one that cannot run it (fp16 with an odd N
misaligns the output's rows) gets an algorithm chosen for its alignment. A product of two
activations (attention's scores and weighted sum, ``batched``) is one strided-batched call,
its algorithm chosen per bucket of M, N and the batch count.

Algorithms run without thread-block clusters (``CUBLASLT_CLUSTER_SHAPE_1x1x1`` set on
cuBLASLt's choice wherever ``cublasLtMatmulAlgoCheck`` accepts it). On the H200 a kernel node
launched in clusters, once its grid is updated from the device (as the patch kernel does
when a shape changes it), runs slower on every later launch: four fp16 (128, 768) x (768,
3072) products went from 17 to 88 us a launch, a non-cluster kernel was unaffected, and
setting the nodes again from the host restored them (bench/results/device_updatable.json).
A clustered decode attention kernel of grape's also computed wrong results after such an
update (device_updatable.clusters.json), so a clustered node's grid is part of its topology
(``cuda_graph.node_records``): with cuBLASLt's clusters, a region would have a topology per
grid. With 1x1x1 clusters GPT-2's fp16 prefill at 128 tokens takes 500.5 us a call in a
topology graph against 489.2 in a per-shape graph
(bench/results/topology_variants.e4b8a95.json), and a per-shape graph about as long as with
cuBLASLt's clusters (491.7 against 500.2 us; the MLP of the GPU tests 14.3 against 13.4:
topology_variants.b111ffc.json).

Row-major ``out[M, N] = x[M, K] @ w[K, N]`` is the column-major ``out^T = w^T x^T``: A is
``w`` (N x K, or K x N transposed when the model holds ``w`` as [N, K]), B is ``x``.

A 16-bit output whose N is not a multiple of 8 (GPT-2's LM head, N = 50257) has rows that
start off 16-byte boundaries, and cuBLASLt then runs an ``align1`` kernel: 843 us for GPT-2's
fp16 LM head at 1024 tokens, 31% of the prefill
(bench/results/gpt2_prefill_kernels.fp16_1024.split_slices.json). So where the weight is
stored [N, K] (each of its rows aligned, K a multiple of 8), N is at least ``SPLIT_MIN_N`` and
no residual is added (``_splits``), the call is split (``CublasLt._matmul_split``): the first
N // 8 * 8 columns into a scratch buffer of aligned rows, copied into place by
``cublasLtMatrixTransform``, and the last columns straight into the output.

Needs ``libcublasLt``: one the process or the system has (a library PyTorch already loaded
serves), else the ``nvidia-cublas`` package's (extra ``cuda``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .active import ThreadInstances, load_shared_library, packaged_libraries, register_once
from .cuda_driver import check, driver
from .signature import nbytes

WORKSPACE_BYTES = 32 << 20  # what TVM's cuBLAS BYOC and PyTorch give cuBLASLt
SCRATCH_BYTES = 32 << 20  # the aligned columns of a split call, a chunk of rows at a time
# Narrower outputs keep their one call (a guess, not measured: the copy's launch would
# outweigh an align1 kernel of so few columns).
SPLIT_MIN_N = 256
# The columns a split call's last product writes straight into the output: the last N % 8
# and the aligned ones before them, computed twice. A workaround, its cause not found: with
# the N % 8 columns alone (a 1 x 1 product at M = 1 for N = 50257) a run on the H200 crashed
# (illegal address), and a graph captured at M = 1, replayed after a call at another M,
# wrote a wrong last column (bench/README.md, "Session of 2026-12-02, second").
TAIL_COLUMNS = 64
assert SPLIT_MIN_N >= TAIL_COLUMNS + 8  # the tail starts past column 0
LIBRARY = "cublaslt"  # its name in a plan's "libraries" (what the runtime must provide)
FUNCTION_PREFIX = f"grape.{LIBRARY}."
_LIBRARIES = ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so")

# cuBLASLt's enums (cublasLt.h, library_types.h).
_CUDA_R = {"float32": 0, "float16": 2, "bfloat16": 14}
_COMPUTE_32F = 68  # fp32 accumulation, full precision (no TF32): PyTorch's default
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_PREF_MAX_WORKSPACE_BYTES = 1
_LAYOUT_BATCH_COUNT, _LAYOUT_STRIDED_BATCH_OFFSET = 5, 6
_ALIGNED_COLUMNS = 8  # 16 bytes of a 16-bit type: what cuBLASLt's fast kernels need of N
_ALGO_CONFIG_ID, _ALGO_CONFIG_SPLITK_NUM, _ALGO_CONFIG_REDUCTION_SCHEME = 0, 2, 3
_ALGO_CONFIG_CLUSTER_SHAPE_ID, _CLUSTER_SHAPE_1x1x1 = 8, 2
_ALGO_CONFIG_TYPES = {_ALGO_CONFIG_CLUSTER_SHAPE_ID: ctypes.c_uint16}  # the others: uint32
# The heuristic's candidates read, best first, and the least of K a split-K part may sum:
# its first choice can split K into more parts than K has elements (fp32, M <= 8, K = 128,
# N = 128: split-K 264, 53.9 us a call where the whole decode step's other kernels take
# 122; bench/results/loop_kernels_decoder_small_b8.7a5959f.json).
HEURISTIC_CANDIDATES = 8
MIN_K_PER_SPLIT = 16
EPILOGUES = {"": 1, "bias": 4, "gelu": 32, "bias_gelu": 36}


class CublasLtError(RuntimeError):
    """cuBLASLt is missing here, or one of its calls failed."""


@dataclass(frozen=True)
class MatmulFunction:
    """What one packed function does: its epilogue, whether ``w`` comes as [N, K], whether
    both operands are batches of matrices (``batched``: attention's products of two
    activations, [..., M, K] by [..., K, N], the same batch dims on both), and whether a
    tensor of the output's shape is added (``residual``: cuBLASLt's C with beta = 1, before
    the epilogue, so only where the epilogue has no activation)."""

    epilogue: str  # a key of EPILOGUES
    transposed_weight: bool
    batched: bool = False
    residual: bool = False

    @property
    def name(self) -> str:
        suffix = "_".join(p for p in ("batched" if self.batched else "", "matmul",
                                      self.epilogue, "residual" if self.residual else "",
                                      "nt" if self.transposed_weight else "")
                          if p)
        return FUNCTION_PREFIX + suffix

    @property
    def has_bias(self) -> bool:
        return "bias" in self.epilogue


MATMUL_FUNCTIONS = {f.name: f for f in [MatmulFunction(e, t) for e in EPILOGUES
                                         for t in (False, True)] +
                    [MatmulFunction(e, t, residual=True) for e in ("", "bias")
                     for t in (False, True)] +
                    [MatmulFunction("", t, batched=True) for t in (False, True)]}


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t),
                ("state", ctypes.c_int), ("wavesCount", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


def _library() -> ctypes.CDLL:
    """libcublasLt: one the process or the system has (by soname), else the one of the
    ``nvidia-cublas`` package."""
    library = load_shared_library(_LIBRARIES, _packaged_libraries())
    if library is None:
        raise CublasLtError("this artifact's matmuls run on cuBLASLt, and no libcublasLt is "
                            f"found here (tried {', '.join(_LIBRARIES)} and the nvidia-cublas "
                            "package): pip install 'grape-tvm[cuda]', or compile with "
                            "--matmul tvm")
    return library


def _packaged_libraries() -> list[Path]:
    """libcublasLt files of the ``nvidia-cublas`` wheels (``nvidia/cu13/lib`` for CUDA 13,
    ``nvidia/cublas/lib`` for CUDA 12), newest first."""
    return packaged_libraries(("cu13/lib", "cublas/lib"), "libcublasLt.so.*")


def _ok(status: int, call: str) -> None:
    if status != 0:
        raise CublasLtError(f"{call} failed: cublasStatus_t {status}")


def bucket(m: int) -> int:
    """The upper end of M's bucket: the next power of two."""
    return 1 << max(m - 1, 0).bit_length()


@dataclass(frozen=True)
class _Problem:
    """The sizes of one call: ``batch`` products of (M x K) by (K x N)."""

    m: int
    k: int
    n: int
    batch: int = 1
    ldc: int = 0  # the output's leading dimension (elements), if not n
    bucket_m: int = 0  # the M the algorithm is chosen at, if not M's bucket

    @property
    def out_ld(self) -> int:
        return self.ldc or self.n

    @staticmethod
    def of(function: MatmulFunction, x, out) -> "_Problem":
        k, n = int(x.shape[-1]), int(out.shape[-1])
        if function.batched:
            return _Problem(int(out.shape[-2]), k, n, int(np.prod(out.shape[:-2], dtype=np.int64)))
        return _Problem(int(np.prod(x.shape[:-1], dtype=np.int64)), k, n)

    def bucket(self, function: MatmulFunction) -> "_Problem":
        """The bucket's upper ends, where the algorithm is chosen: M rounded up to a power
        of two; for products of two activations K, N and the batch too (a past length is
        N of ``q @ k^T`` and K of ``p @ v``); K and N of a weight as they are."""
        if function.batched:
            return _Problem(bucket(self.m), bucket(self.k), bucket(self.n), bucket(self.batch))
        return _Problem(self.bucket_m or bucket(self.m), self.k, self.n, ldc=self.ldc)

    def alignment(self, dtype: str) -> int:
        """Bytes (up to 16) every leading dimension and size of the problem is a multiple
        of: what an algorithm's vector loads may assume."""
        size = np.dtype(dtype).itemsize
        return min(16, *(b & -b for b in (self.k * size, self.n * size, self.out_ld * size)))

    def describe(self, function: MatmulFunction) -> str:
        if function.batched:
            return f"batch<={self.batch}/M<={self.m}/K={self.k}/N<={self.n}"
        ld = f"/ld={self.ldc}" if self.ldc and self.ldc != self.n else ""
        return f"M<={self.m}/K={self.k}/N={self.n}{ld}"


@dataclass(frozen=True)
class _Operands:
    """Device addresses of one call's operands (bias and residual: None if it has none)."""

    x: int
    w: int
    out: int
    bias: int | None = None
    residual: int | None = None


def _splits(function: MatmulFunction, dtype: str, problem: _Problem, residual) -> bool:
    """Whether a call runs split (``CublasLt._matmul_split``): a 16-bit output whose rows
    misalign (N not a multiple of 8), wide enough to pay for the copy, from a weight stored
    [N, K] with aligned rows (a [K, N] weight's rows misalign as the output's do). A
    residual would need the same split: such calls keep their one call."""
    size = np.dtype(dtype).itemsize
    return (not function.batched and residual is None and function.transposed_weight
            and size == 2 and problem.n % _ALIGNED_COLUMNS != 0
            and problem.n >= SPLIT_MIN_N and problem.k % _ALIGNED_COLUMNS == 0
            and _chunk_rows((problem.n - problem.n % _ALIGNED_COLUMNS) * size) > 0)


def _chunk_rows(row_bytes: int) -> int:
    """Rows of a split call's chunk: as many as the scratch buffer holds, a power of two
    (0 if not one row fits)."""
    rows = SCRATCH_BYTES // row_bytes
    return 1 << (rows.bit_length() - 1) if rows else 0


@dataclass
class _Plan:
    """A matmul descriptor and the algorithm cuBLASLt chose for it."""

    desc: ctypes.c_void_p
    algo: _Heuristic


class CublasLt:
    """A cuBLASLt handle, a workspace and the algorithm chosen per bucket; one per backend,
    which frees it (``close``). ``active`` makes it the one the packed functions use."""

    def __init__(self, device_index: int = 0):
        self.lib = _library()
        self.lib.cublasLtMatmul.argtypes = [ctypes.c_void_p] * 14 + [ctypes.c_size_t, ctypes.c_void_p]
        self.lib.cublasLtMatrixTransform.argtypes = [ctypes.c_void_p] * 11
        self.device_index = device_index
        self.handle = ctypes.c_void_p()
        _ok(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = check(driver.cuMemAlloc(WORKSPACE_BYTES), "cuMemAlloc(cuBLASLt workspace)")
        self._plans: dict[tuple, _Plan] = {}  # per bucket and alignment; owns the descriptors
        self._plan_of: dict[tuple, _Plan] = {}  # per exact problem: the plan that ran it
        self._layouts: dict[tuple, ctypes.c_void_p] = {}
        self.chosen: dict[str, dict] = {}  # for inspect: the algorithm of each bucket
        self._scratch = None  # split calls' aligned columns (``_matmul_split``)
        self._transform = None  # their copy's descriptor

    # -- the packed functions' work --------------------------------------------------------
    def matmul(self, function: MatmulFunction, x, w, out, bias, stream: int,
               residual=None) -> None:
        """``out = epilogue(x @ w (+ residual) (+ bias))`` on ``stream``; x: [..., K], w:
        [K, N] or [N, K] (``transposed_weight``), out and residual: [..., N], all of one
        dtype. ``batched``: x [..., M, K], w [..., K, N] or [..., N, K], out [..., M, N],
        one product per batch."""
        dtype = str(out.dtype)
        problem = _Problem.of(function, x, out)
        if problem.m == 0 or problem.batch == 0 or problem.n == 0:
            return
        if problem.k == 0:  # a sum over nothing (attention over an empty source): zeros
            if not function.batched:
                raise CublasLtError(f"{function.name}: a matmul over K = 0 with a weight")
            check(driver.cuMemsetD8Async(out.data_ptr(), 0, nbytes(out), stream),
                  "cuMemsetD8Async")
            return
        if residual is not None and (nbytes(residual) != nbytes(out) or
                                     str(residual.dtype) != dtype):
            raise CublasLtError(f"{function.name}: the residual is {residual.dtype}"
                                f"{tuple(residual.shape)}, the output {dtype}{tuple(out.shape)}")
        operands = _Operands(x.data_ptr(), w.data_ptr(), out.data_ptr(),
                             None if bias is None else bias.data_ptr(),
                             None if residual is None else residual.data_ptr())
        if _splits(function, dtype, problem, residual):
            self._matmul_split(function, dtype, problem, operands, stream)
        else:
            self._launch(function, dtype, problem, operands, stream)

    def _launch(self, function: MatmulFunction, dtype: str, problem: "_Problem",
                operands: "_Operands", stream: int) -> None:
        """One ``cublasLtMatmul`` of ``problem`` on ``operands``."""
        plan = self._plan(function, dtype, problem, operands.bias)
        alpha = ctypes.c_float(1.0)
        beta = ctypes.c_float(1.0 if operands.residual is not None else 0.0)
        source = operands.out if operands.residual is None else operands.residual  # C
        a, b, c = self._layouts_of(function, dtype, problem)
        if operands.bias is not None:
            pointer = ctypes.c_void_p(operands.bias)
            _ok(self.lib.cublasLtMatmulDescSetAttribute(plan.desc, _DESC_BIAS_POINTER,
                                                        ctypes.byref(pointer), ctypes.c_size_t(8)),
                "cublasLtMatmulDescSetAttribute(bias)")
        _ok(self.lib.cublasLtMatmul(
            self.handle, plan.desc, ctypes.addressof(alpha), operands.w, a, operands.x, b,
            ctypes.addressof(beta), source, c, operands.out, c,
            ctypes.addressof(plan.algo.algo), int(self.workspace), WORKSPACE_BYTES, stream),
            f"cublasLtMatmul({function.name}, {dtype}, batch={problem.batch}, M={problem.m}, "
            f"K={problem.k}, N={problem.n})")

    def _matmul_split(self, function: MatmulFunction, dtype: str, problem: "_Problem",
                      operands: "_Operands", stream: int) -> None:
        """``_splits``' call: the first N // 8 * 8 columns (aligned rows) into the scratch
        buffer and copied into place, a chunk of rows at a time; then the last
        ``TAIL_COLUMNS`` columns (the N % 8 left, and aligned ones again) straight into the
        output. Past one chunk, every chunk runs the algorithm chosen at the chunk's rows:
        topologies follow the chunk count, not the last chunk's rows."""
        size = np.dtype(dtype).itemsize
        m, k, n = problem.m, problem.k, problem.n
        aligned = n - n % _ALIGNED_COLUMNS
        chunk = _chunk_rows(aligned * size)
        scratch = self._scratch_address()
        for first in range(0, m, chunk):
            rows = min(chunk, m - first)
            part = _Problem(rows, k, aligned, bucket_m=chunk if m > chunk else 0)
            self._launch(function, dtype, part,
                         _Operands(operands.x + first * k * size, operands.w, scratch,
                                   operands.bias), stream)
            self._copy_columns(dtype, aligned, rows, scratch, operands.out + first * n * size,
                               n, stream)
        tail = n - TAIL_COLUMNS  # w's rows start 16-byte aligned: K is a multiple of 8
        self._launch(function, dtype, _Problem(m, k, TAIL_COLUMNS, ldc=n),
                     _Operands(operands.x, operands.w + tail * k * size,
                               operands.out + tail * size,
                               None if operands.bias is None else operands.bias + tail * size),
                     stream)

    def _copy_columns(self, dtype: str, columns: int, rows: int, source: int, out: int,
                      out_ld: int, stream: int) -> None:
        """Copy ``rows`` rows of ``columns`` elements from ``source`` (rows packed) to
        ``out`` (rows ``out_ld`` apart), with cuBLASLt's matrix transform."""
        if self._transform is None:
            desc = ctypes.c_void_p()
            _ok(self.lib.cublasLtMatrixTransformDescCreate(ctypes.byref(desc),
                                                           _CUDA_R["float32"]),
                "cublasLtMatrixTransformDescCreate")
            self._transform = desc
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        _ok(self.lib.cublasLtMatrixTransform(
            self.handle, self._transform, ctypes.addressof(alpha), source,
            self._layout(dtype, columns, rows, columns), ctypes.addressof(beta), None, None,
            out, self._layout(dtype, columns, rows, out_ld), stream),
            f"cublasLtMatrixTransform({dtype}, {rows} x {columns})")

    def _scratch_address(self) -> int:
        """The scratch buffer of split calls, allocated on first use and never moved (the
        graphs captured since hold its address)."""
        if self._scratch is None:
            self._scratch = check(driver.cuMemAlloc(SCRATCH_BYTES), "cuMemAlloc(cuBLASLt scratch)")
        return int(self._scratch)

    def _layouts_of(self, function: MatmulFunction, dtype: str, problem: "_Problem"):
        """Layouts of A (w), B (x) and C (out) in cuBLASLt's column-major terms."""
        m, k, n, batch = problem.m, problem.k, problem.n, problem.batch
        a = self._layout(dtype, n, k, k if function.transposed_weight else n,
                         transposed=function.transposed_weight, batch=batch)
        return a, self._layout(dtype, k, m, k, batch=batch), self._layout(dtype, n, m,
                                                                             problem.out_ld,
                                                                             batch=batch)

    def _layout(self, dtype: str, rows: int, cols: int, ld: int, transposed: bool = False,
                batch: int = 1):
        """A column-major matrix layout; ``transposed``: stored as its transpose (cols x
        rows); ``batch`` > 1: that many such matrices, one after the other."""
        stored = (cols, rows) if transposed else (rows, cols)
        key = (dtype, *stored, ld, batch)
        layout = self._layouts.get(key)
        if layout is None:
            layout = ctypes.c_void_p()
            _ok(self.lib.cublasLtMatrixLayoutCreate(
                ctypes.byref(layout), _CUDA_R[dtype], ctypes.c_uint64(stored[0]),
                ctypes.c_uint64(stored[1]), ctypes.c_int64(ld)), "cublasLtMatrixLayoutCreate")
            try:
                if batch > 1:
                    self._set_batch(layout, batch, stored[0] * stored[1])
            except BaseException:  # half-made: a layout without its batch computes one product
                self.lib.cublasLtMatrixLayoutDestroy(layout)
                raise
            self._layouts[key] = layout
        return layout

    def _set_batch(self, layout, batch: int, stride: int) -> None:
        for attribute, value in ((_LAYOUT_BATCH_COUNT, ctypes.c_int32(batch)),
                                 (_LAYOUT_STRIDED_BATCH_OFFSET, ctypes.c_int64(stride))):
            _ok(self.lib.cublasLtMatrixLayoutSetAttribute(
                layout, attribute, ctypes.byref(value), ctypes.c_size_t(ctypes.sizeof(value))),
                "cublasLtMatrixLayoutSetAttribute")

    def _plan(self, function: MatmulFunction, dtype: str, problem: "_Problem",
              bias: int | None) -> _Plan:
        """The bucket's plan, checked for this exact problem once (an algorithm chosen at
        the bucket's upper end may not support a smaller size: fp16 with N = 7 misaligns
        the output's rows); where it does not, one chosen for the problem itself."""
        exact = (function.name, dtype, problem)
        plan = self._plan_of.get(exact)
        if plan is None:
            upper = problem.bucket(function)
            key = (function.name, dtype, upper, problem.alignment(dtype))
            plan = self._plans.get(key)
            if plan is None:
                # The bucket's algorithm, from its upper end; if it cannot run the first
                # problem of its alignment here, from that problem (kept for the others).
                plan, at = self._choose_at_upper_end(function, dtype, upper, problem, bias), upper
                if plan is None:
                    plan, at = self._choose(function, dtype, problem, bias), problem
                self._keep(key, plan, f"{function.name}/{dtype}/{at.describe(function)}/"
                           f"aligned {key[-1]}")
            elif not self._supports(plan, function, dtype, problem):
                plan = self._choose(function, dtype, problem, bias)
                self._keep(exact, plan, f"{function.name}/{dtype}/{problem.describe(function)}"
                           "/this size")
            self._plan_of[exact] = plan
        return plan

    def _choose_at_upper_end(self, function: MatmulFunction, dtype: str, upper: "_Problem",
                             problem: "_Problem", bias: int | None) -> _Plan | None:
        """cuBLASLt's choice at the bucket's upper end if it runs ``problem``, else None."""
        try:
            plan = self._choose(function, dtype, upper, bias)
        except CublasLtError:  # nothing at the upper end: the problem itself may have one
            return None
        if self._supports(plan, function, dtype, problem):
            return plan
        self._release(plan)
        return None

    def _supports(self, plan: _Plan, function: MatmulFunction, dtype: str,
                  problem: "_Problem") -> bool:
        """Whether the plan's algorithm runs ``problem`` (``_check``)."""
        return self._check(plan.desc, plan.algo, function, dtype, problem) is not None

    def _check(self, desc, found: _Heuristic, function: MatmulFunction, dtype: str,
               problem: "_Problem") -> _Heuristic | None:
        """``cublasLtMatmulAlgoCheck`` of ``found``'s algorithm on ``problem``'s layouts: its
        result, or None where it cannot run it within the workspace."""
        a, b, c = self._layouts_of(function, dtype, problem)
        result = _Heuristic()
        status = self.lib.cublasLtMatmulAlgoCheck(self.handle, desc, a, b, c, c,
                                                  ctypes.byref(found.algo), ctypes.byref(result))
        return result if status == 0 and result.workspaceSize <= WORKSPACE_BYTES else None

    def _release(self, plan: _Plan) -> None:
        self.lib.cublasLtMatmulDescDestroy(plan.desc)

    def _choose(self, function: MatmulFunction, dtype: str, problem: "_Problem",
                bias: int | None) -> _Plan:
        """A descriptor for ``function``, and cuBLASLt's choice for ``problem``."""
        desc = ctypes.c_void_p()
        _ok(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _CUDA_R["float32"]),
            "cublasLtMatmulDescCreate")
        try:
            found = self._heuristic(desc, function, dtype, problem, bias)
        except BaseException:
            self.lib.cublasLtMatmulDescDestroy(desc)
            raise
        return _Plan(desc, found)

    def _heuristic(self, desc, function: MatmulFunction, dtype: str, problem: "_Problem",
                   bias: int | None) -> _Heuristic:
        """Set ``desc``'s attributes; the heuristic's choice for ``problem`` (``_sensible``,
        then ``_without_clusters``)."""
        for attr, value in ((_DESC_TRANSA, _OP_T if function.transposed_weight else _OP_N),
                            (_DESC_TRANSB, _OP_N), (_DESC_EPILOGUE, EPILOGUES[function.epilogue])):
            box = ctypes.c_int32(value)
            _ok(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(box),
                                                        ctypes.c_size_t(4)),
                "cublasLtMatmulDescSetAttribute")
        if bias is not None:  # the heuristic reads the bias address's alignment
            pointer = ctypes.c_void_p(bias)
            _ok(self.lib.cublasLtMatmulDescSetAttribute(desc, _DESC_BIAS_POINTER,
                                                        ctypes.byref(pointer), ctypes.c_size_t(8)),
                "cublasLtMatmulDescSetAttribute(bias)")
        pref = ctypes.c_void_p()
        _ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            size = ctypes.c_uint64(WORKSPACE_BYTES)
            _ok(self.lib.cublasLtMatmulPreferenceSetAttribute(
                pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), ctypes.c_size_t(8)),
                "cublasLtMatmulPreferenceSetAttribute")
            a, b, c = self._layouts_of(function, dtype, problem)
            candidates, count = (_Heuristic * HEURISTIC_CANDIDATES)(), ctypes.c_int()
            _ok(self.lib.cublasLtMatmulAlgoGetHeuristic(
                self.handle, desc, a, b, c, c, pref, HEURISTIC_CANDIDATES, candidates,
                ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        finally:
            self.lib.cublasLtMatmulPreferenceDestroy(pref)
        if count.value < 1:
            raise CublasLtError(f"cuBLASLt has no algorithm for {function.name} {dtype} "
                                f"{problem.describe(function)}")
        found = self._sensible(desc, candidates[:count.value], function, dtype, problem)
        self._without_clusters(desc, found, function, dtype, problem)
        return found

    def _sensible(self, desc, candidates: list, function: MatmulFunction, dtype: str,
                  problem: "_Problem") -> _Heuristic:
        """The heuristic's best candidate whose split-K parts each sum at least
        ``MIN_K_PER_SPLIT`` of K. Where none does (fp32, M <= 8, N = 128, K = 128 and 512 on
        the H200), its first, split into K // MIN_K_PER_SPLIT parts where cuBLASLt accepts
        it, else as it is. A batched product's K is its bucket's upper end: a size lower in
        the bucket may leave a part half as much."""
        most = max(problem.k // MIN_K_PER_SPLIT, 1)
        for candidate in candidates:
            if self._split_k(candidate) <= most:
                return _Heuristic.from_buffer_copy(candidate)  # its own bytes, not a view
        found = _Heuristic.from_buffer_copy(candidates[0])
        self._configured(desc, found, _ALGO_CONFIG_SPLITK_NUM, most, function, dtype, problem)
        return found

    def _split_k(self, found: _Heuristic) -> int:
        """``found``'s split-K parts (1 where it does not split: cuBLASLt reads back 0 or
        all ones for algorithms without split-K)."""
        split = self._algo_config(found, _ALGO_CONFIG_SPLITK_NUM)
        return 1 if split in (0, 0xFFFFFFFF) else split

    def _without_clusters(self, desc, found: _Heuristic, function: MatmulFunction, dtype: str,
                          problem: "_Problem") -> None:
        """Ask ``found``'s algorithm for 1x1x1 clusters (module docstring: device-side updates
        slow clustered kernels); left as it was where cuBLASLt refuses."""
        self._configured(desc, found, _ALGO_CONFIG_CLUSTER_SHAPE_ID, _CLUSTER_SHAPE_1x1x1,
                         function, dtype, problem)

    def _configured(self, desc, found: _Heuristic, attribute: int, value: int,
                    function: MatmulFunction, dtype: str, problem: "_Problem") -> None:
        """Set one config ``attribute`` of ``found``'s algorithm and keep it, with the
        workspace it then needs, where ``cublasLtMatmulAlgoCheck`` accepts it within the
        workspace; else restore the algorithm byte for byte."""
        saved = bytes(found.algo)
        box = _ALGO_CONFIG_TYPES.get(attribute, ctypes.c_uint32)(value)
        checked = None
        if self.lib.cublasLtMatmulAlgoConfigSetAttribute(
                ctypes.byref(found.algo), attribute, ctypes.byref(box),
                ctypes.c_size_t(ctypes.sizeof(box))) == 0:
            checked = self._check(desc, found, function, dtype, problem)
        if checked is None:
            ctypes.memmove(ctypes.addressof(found.algo), saved, len(saved))
        else:
            found.workspaceSize = checked.workspaceSize

    def _keep(self, key: tuple, plan: _Plan, where: str) -> None:
        """Own ``plan`` under ``key``; ``chosen`` says, for inspect, what it is."""
        self._plans[key] = plan
        self.chosen[where] = {
            "algo_id": self._algo_config(plan.algo, _ALGO_CONFIG_ID),
            "split_k": self._split_k(plan.algo),
            "reduction_scheme": self._algo_config(plan.algo, _ALGO_CONFIG_REDUCTION_SCHEME),
            "cluster_shape_id": self._algo_config(plan.algo, _ALGO_CONFIG_CLUSTER_SHAPE_ID),
            "workspace_bytes": int(plan.algo.workspaceSize)}

    def _algo_config(self, found: _Heuristic, attribute: int) -> int:
        value, written = _ALGO_CONFIG_TYPES.get(attribute, ctypes.c_uint32)(), ctypes.c_size_t()
        _ok(self.lib.cublasLtMatmulAlgoConfigGetAttribute(
            ctypes.byref(found.algo), attribute, ctypes.byref(value),
            ctypes.c_size_t(ctypes.sizeof(value)), ctypes.byref(written)),
            "cublasLtMatmulAlgoConfigGetAttribute")
        return value.value

    # -- ownership --------------------------------------------------------------------------
    def active(self):
        """Calls of the packed functions on this thread use this instance meanwhile."""
        return _INSTANCES.activated(self)

    def close(self) -> None:
        """Free the descriptors, the layouts, the workspace, the split calls' scratch buffer
        and transform descriptor, and the handle; idempotent."""
        if self.handle is None:
            return
        for plan in self._plans.values():
            self._release(plan)
        for layout in self._layouts.values():
            self.lib.cublasLtMatrixLayoutDestroy(layout)
        self._plans.clear()
        self._plan_of.clear()
        self._layouts.clear()
        driver.cuMemFree(self.workspace)
        if self._scratch is not None:
            driver.cuMemFree(self._scratch)
            self._scratch = None
        if self._transform is not None:
            self.lib.cublasLtMatrixTransformDescDestroy(self._transform)
            self._transform = None
        self.lib.cublasLtDestroy(self.handle)
        self.handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # pylint: disable=broad-except
            pass  # interpreter shutdown


# The CublasLt a packed function call on this thread uses (its scratch buffer, too, kept
# with it once a split call ran).
_INSTANCES = ThreadInstances(CublasLt)


def _packed(function: MatmulFunction):
    """The body of packed function ``function.name``: TVM's VM passes the inputs, then the
    output (destination passing)."""
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    def call(*args: Any) -> None:
        x, w, *rest, out = args
        instance = _INSTANCES.current(out.device.index)
        bias = rest.pop(0) if function.has_bias else None
        residual = rest.pop(0) if function.residual else None
        stream = tvm_ffi.get_raw_stream(out.device)
        instance.matmul(function, x, w, out, bias, int(stream or 0), residual)

    return call


def register_functions() -> None:
    """Register every ``MATMUL_FUNCTIONS`` entry with TVM (idempotent)."""
    register_once(MATMUL_FUNCTIONS, _packed)
