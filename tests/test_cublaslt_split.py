"""How ``CublasLt`` splits a 16-bit matmul whose output rows misalign: which calls, over which
rows and columns, at which addresses. The kernels themselves run in tests/test_gpu.py
(``test_outputs_of_odd_width_run_split_and_equal_numpy``); this checks the partition on the
CPU, call by call, with the calls recorded instead of made."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from grape_tvm.runtime.cublaslt import (
    SCRATCH_BYTES,
    TAIL_COLUMNS,
    CublasLt,
    MatmulFunction,
    _Operands,
    _Problem,
    _splits,
)

SCRATCH = 1 << 40
X, W, OUT, BIAS = 1 << 32, 2 << 32, 3 << 32, 4 << 32


class _Recorded(CublasLt):
    """A CublasLt whose library calls are recorded (no library, no GPU)."""

    def __init__(self):  # pylint: disable=super-init-not-called
        self.handle = None  # nothing to close
        self._scratch = SCRATCH
        self.calls: list[tuple] = []

    def _launch(self, function, dtype, problem, operands, stream):
        self.calls.append(("matmul", problem, operands))

    def _copy_columns(self, dtype, columns, rows, source, out, out_ld, stream):
        self.calls.append(("copy", columns, rows, source, out, out_ld))


def _written(calls, m: int, k: int, n: int, size: int, bias: bool) -> np.ndarray:
    """How often each element of the [m, n] output is written, following the calls: a
    matmul into the scratch buffer, then its copy into place, or a matmul straight into the
    output. Checks on the way that each piece reads the rows of x and of w it stands for."""
    written = np.zeros((m, n), dtype=np.int64)
    scratch_rows = None  # (first row of x, rows, columns) the scratch buffer holds
    for call in calls:
        if call[0] == "matmul":
            _, problem, ops = call
            first_row, rem = divmod(ops.x - X, k * size)
            first_col, rem_w = divmod(ops.w - W, k * size)
            assert rem == 0 and rem_w == 0
            if ops.out == SCRATCH:
                assert problem.out_ld == problem.n  # the scratch holds its rows packed
                assert ops.bias == (BIAS if bias else None)
                scratch_rows = (first_row, problem.m, problem.n, first_col)
            else:
                col, rem = divmod(ops.out - OUT, size)
                assert rem == 0 and col == first_col  # column c from w's row c
                assert problem.out_ld == n
                assert ops.bias == (BIAS + col * size if bias else None)
                written[first_row:first_row + problem.m, col:col + problem.n] += 1
        else:
            _, columns, rows, source, out, out_ld = call
            assert source == SCRATCH and out_ld == n and scratch_rows is not None
            first_row, held_rows, held_columns, first_col = scratch_rows
            row, rem = divmod(out - OUT, n * size)
            assert rem == 0 and row == first_row and rows == held_rows
            assert columns == held_columns and first_col == 0
            written[row:row + rows, :columns] += 1
    return written


@pytest.mark.parametrize("m", [1, 7, 255, 256, 257, 300, 1024])
@pytest.mark.parametrize("n", [50257, 4099, 263])
@pytest.mark.parametrize("bias", [False, True])
def test_a_split_call_writes_every_output_element_once(m, n, bias):
    k, size = 768, 2
    function = MatmulFunction("bias" if bias else "", transposed_weight=True)
    problem = _Problem(m, k, n)
    assert _splits(function, "float16", problem, None)
    recorded = _Recorded()
    recorded._matmul_split(function, "float16", problem,  # pylint: disable=protected-access
                           _Operands(X, W, OUT, BIAS if bias else None), stream=0)
    written = _written(recorded.calls, m, k, n, size, bias)
    aligned = n // 8 * 8
    assert (written[:, :n - TAIL_COLUMNS] == 1).all()
    assert (written[:, n - TAIL_COLUMNS:aligned] == 2).all()  # copied, then the tail's
    assert (written[:, aligned:] == 1).all()
    last = recorded.calls[-1]  # the tail, after every copy: its values are the ones left
    assert last[0] == "matmul" and last[1].n == TAIL_COLUMNS and last[2].out != SCRATCH
    chunk_rows = SCRATCH_BYTES // (n // 8 * 8 * size)
    for call in recorded.calls:
        if call[0] == "matmul" and call[2].out == SCRATCH:
            assert call[1].m <= chunk_rows  # a chunk fits the scratch buffer


def test_chunks_past_the_first_share_one_algorithm_bucket():
    """Past one chunk, every chunk is planned at the chunk's rows: the last chunk's rows
    change neither the algorithm nor the topology."""
    function = MatmulFunction("", transposed_weight=True)
    for m in (300, 400, 1000):
        recorded = _Recorded()
        recorded._matmul_split(function, "float16", _Problem(m, 768, 50257),  # pylint: disable=protected-access
                               _Operands(X, W, OUT), stream=0)
        buckets = {c[1].bucket(function).m for c in recorded.calls
                   if c[0] == "matmul" and c[2].out == SCRATCH}
        assert buckets == {256}, (m, buckets)


@pytest.mark.parametrize("function, dtype, problem, why", [
    (MatmulFunction("", True), "float32", _Problem(64, 768, 50257), "fp32 rows align at 4"),
    (MatmulFunction("", False), "float16", _Problem(64, 768, 50257), "[K, N] weight"),
    (MatmulFunction("", True), "float16", _Problem(64, 768, 50256), "N a multiple of 8"),
    (MatmulFunction("", True), "float16", _Problem(64, 768, 9), "too narrow to pay"),
    (MatmulFunction("", True), "float16", _Problem(64, 770, 50257), "K misaligns w's rows"),
    (MatmulFunction("", True, batched=True), "float16", _Problem(64, 768, 50257), "batched"),
])
def test_calls_that_are_not_split(function, dtype, problem, why):
    assert not _splits(function, dtype, problem, None), why


def test_a_residual_call_is_not_split():
    assert not _splits(MatmulFunction("", True, residual=True), "float16",
                       _Problem(64, 768, 50257), residual=object())


class _Library:
    """cuBLASLt's entry points ``_launch`` and ``_copy_columns`` call, recording the layouts
    and addresses they are given (a layout is the tuple ``_Laid._layout`` makes)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def cublasLtMatmulDescSetAttribute(self, *args):  # pylint: disable=invalid-name
        return 0

    def cublasLtMatmul(self, handle, desc, alpha, w, a, x, b, beta, c, c_layout, d, d_layout,
                       *rest):  # pylint: disable=invalid-name
        self.calls.append(("matmul", a, b, d_layout, w, x, d))
        return 0

    def cublasLtMatrixTransformDescCreate(self, *args):  # pylint: disable=invalid-name
        return 0

    def cublasLtMatrixTransform(self, handle, desc, alpha, a, a_layout, beta, b, b_layout, c,
                                c_layout, stream):  # pylint: disable=invalid-name
        self.calls.append(("copy", a_layout, c_layout, a, c))
        return 0


class _Laid(CublasLt):
    """A CublasLt whose library is ``_Library`` and whose layouts are plain tuples
    ``(rows, cols, ld, transposed)`` in cuBLASLt's column-major terms."""

    def __init__(self):  # pylint: disable=super-init-not-called
        self.handle = None
        self.lib = _Library()
        self._scratch = SCRATCH
        self._transform = "descriptor"
        self.workspace = 0

    def _plan(self, function, dtype, problem, bias):
        algo = type("Algo", (), {"algo": (ctypes.c_uint64 * 8)()})()
        return type("Plan", (), {"desc": None, "algo": algo})()

    def _layout(self, dtype, rows, cols, ld, transposed=False, batch=1):
        return (rows, cols, ld, transposed)


@pytest.mark.parametrize("m", [1, 300])
def test_a_split_call_hands_cublaslt_the_layouts_of_its_pieces(m):
    """The products' output layouts (packed rows in the scratch buffer, the output's N
    apart for the tail) and the copy's (scratch to output): what only the GPU would show
    wrong otherwise."""
    n, k = 50257, 768
    aligned = n // 8 * 8
    laid = _Laid()
    laid._matmul_split(MatmulFunction("", transposed_weight=True), "float16",  # pylint: disable=protected-access
                       _Problem(m, k, n), _Operands(X, W, OUT), stream=0)
    chunk = SCRATCH_BYTES // (aligned * 2)
    chunk = 1 << (chunk.bit_length() - 1)
    for call in laid.lib.calls:
        if call[0] == "matmul":
            _, a, b, d_layout, w, x, d = call
            columns = a[0]  # A: the product's columns of w, stored [N, K] (transposed)
            assert a == (columns, k, k, True)
            assert b[0] == k and b[2] == k  # x: (k, rows), rows k apart
            if d == SCRATCH:
                assert d_layout == (aligned, b[1], aligned, False) and columns == aligned
            else:
                assert d_layout == (TAIL_COLUMNS, m, n, False) and columns == TAIL_COLUMNS
                assert d == OUT + (n - TAIL_COLUMNS) * 2 and w == W + (n - TAIL_COLUMNS) * k * 2
        else:
            _, a_layout, c_layout, source, out = call
            rows = a_layout[1]
            assert source == SCRATCH and rows <= chunk
            assert a_layout == (aligned, rows, aligned, False)
            assert c_layout == (aligned, rows, n, False)
    copied = sum(c[1][1] for c in laid.lib.calls if c[0] == "copy")
    assert copied == m
