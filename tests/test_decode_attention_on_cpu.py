"""grape's decode attention kernel (``runtime/kernels/decode_attention.cu``) run on the CPU
and checked against numpy.

The kernel's own source, compiled with g++ against ``cuda_on_cpu.h`` (a CUDA thread per OS
thread, the warp shuffles as exchanges among 32 threads), is launched on strided views as
``runtime/attention.py`` passes them: q heads sliced out of a packed qkv, the output written
[batch, rows, heads, head_dim], a bias broadcast over heads, the causal mode, keys over
several tiles of every warp, masked keys. Blocks run in one order and in the reverse order.
What the GPU adds (timing, the driver, the graphs) is tests/test_gpu.py's
(``test_decode_attention_equals_numpy``).
"""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
from dataclasses import dataclass

import numpy as np
import pytest

from grape_tvm.runtime.attention import (DECODE_SOURCE, MAX_SPLITS, SPLIT_ROWS,
                                         WIDE_DECODE_DTYPES, AttentionFunction,
                                         AttentionLayout, KeySplit, ViewLayout, copy_blocks,
                                         decode_splits, kernel_arguments, kernel_grid,
                                         runs_wide)
from grape_tvm.runtime.cuda_compile import kernel_params
from test_gemv_on_cpu import HEADER, _gxx_cxx20_float16

pytestmark = pytest.mark.skipif(not _gxx_cxx20_float16(),
                                reason="needs g++ with C++20 <barrier> and _Float16")

THREADS = 256  # the kernel's block (kWarps = 8); on a GPU, read from the function
WIDE_THREADS = 512  # the _wide kernels' (kWideWarps = 16)
# (dtype, head_dim, wide, append) -> (kernel, threads a block)
KERNELS = {(dtype, d, wide, append): (
    AttentionFunction(False, False, decode=True, append=append).kernel(dtype, d, wide),
    WIDE_THREADS if wide else THREADS)
    for dtype in ("float32", "float16", "bfloat16") for d in (64, 128)
    for wide in ((False, True) if dtype in WIDE_DECODE_DTYPES else (False,))
    for append in (False, True)}


@pytest.fixture(scope="module")
def kernels(tmp_path_factory) -> ctypes.CDLL:
    wrappers = "".join(
        f'extern "C" void run_{name}(void** a, unsigned gx, unsigned gy, unsigned gz) {{\n'
        f"  launch([=]() {{ {name}({_arguments(dtype, append)}); }}, gx, gy, {threads}, 1, gz);\n"
        "}\n" for (dtype, _, _, append), (name, threads) in KERNELS.items())
    code = (f'#include "{HEADER}"\nusing std::min;\n#define GRAPE_CPU_HALF 1\n'
            '#define GRAPE_CPU_BF16 1\n'
            f'#include "{DECODE_SOURCE}"\n{wrappers}')
    workdir = tmp_path_factory.mktemp("decode_attention")
    digest = hashlib.sha256((code + DECODE_SOURCE.read_text()).encode()).hexdigest()[:16]
    lib = workdir / f"k_{digest}.so"
    src = lib.with_suffix(".cpp")
    src.write_text(code)
    subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", "-o",
                    str(lib), str(src)], check=True, capture_output=True)
    return ctypes.CDLL(str(lib))


def _arguments(dtype: str, append: bool) -> str:
    """The kernel's arguments read from ``kernel_params``' array (runtime/attention.py's
    ``kernel_arguments``, in order): five pointers, three ints, fifteen strides, the scale,
    the split's two pointers and its count; appending, four pointers, the past's rows and
    twelve strides."""
    element = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}[dtype]
    pointers = [f"({element}*)*(void**)a[{i}]" for i in range(5)]
    ints = [f"*(int*)a[{i}]" for i in range(5, 8)]
    strides = [f"*(long long*)a[{i}]" for i in range(8, 23)]
    split = ["(float*)*(void**)a[24]", "(unsigned*)*(void**)a[25]", "*(int*)a[26]"]
    cache = []
    if append:
        cache = [f"({element}*)*(void**)a[{i}]" for i in range(27, 31)] + ["*(int*)a[31]"]
        cache += [f"*(long long*)a[{i}]" for i in range(32, 44)]
    return ", ".join(pointers + ints + strides + ["*(float*)a[23]"] + split + cache)


@dataclass
class View:
    """A [batch, heads, rows, head_dim] view of ``base`` (a flat array), in elements."""

    base: np.ndarray
    offset: int
    batch: int
    head: int
    row: int

    def read(self, shape) -> np.ndarray:
        b, h, r, d = shape
        itemsize = self.base.itemsize
        return np.lib.stride_tricks.as_strided(
            self.base[self.offset:], (b, h, r, d),
            (self.batch * itemsize, self.head * itemsize, self.row * itemsize, itemsize))


def _run(kernels, dtype, q: View, k: View, v: View, out: View, bias: View | None, shape,
         keys: int, causal: bool, scale: float, reverse: bool, splits: int | None = None,
         append: dict[str, View] | None = None, past: int | None = None) -> int:
    """Launch the kernel as ``FusedAttention.launch`` does (its parameters, grid and split
    from runtime/attention.py); the blocks a row took. ``append``: the _append kernel's
    views by name (``AttentionLayout.APPEND_VIEWS``), k and v the past caches of ``past``
    rows."""
    batch, heads, rows, head_dim = shape
    views = [ViewLayout(0, x.batch, x.head, x.row) for x in (q, k, v, out)]
    bias_view = ViewLayout(0, 0, 0, 0) if bias is None else ViewLayout(0, bias.batch, bias.head,
                                                                       bias.row)
    cache = {} if append is None else {
        n: ViewLayout(0, append[n].batch, append[n].head, append[n].row)
        for n in AttentionLayout.APPEND_VIEWS}
    layout = AttentionLayout(batch, heads, rows, keys, head_dim, *views, bias_view, past=past,
                             **cache)
    function = AttentionFunction(bias=bias is not None, causal=causal, decode=True,
                                 append=append is not None)
    partials = np.full(SPLIT_ROWS * MAX_SPLITS * (head_dim + 2), np.nan, np.float32)
    counters = np.zeros(SPLIT_ROWS, np.uint32)
    split = KeySplit(splits or decode_splits(layout, THREADS), partials.ctypes.data,
                     counters.ctypes.data)
    wide = runs_wide(layout, dtype, THREADS, split.splits)  # as FusedAttention.launch
    addresses = [x.base[x.offset:].ctypes.data for x in (q, k, v)]
    addresses += [0 if bias is None else bias.base[bias.offset:].ctypes.data,
                  out.base[out.offset:].ctypes.data]
    if append is not None:
        addresses += [append[n].base[append[n].offset:].ctypes.data
                      for n in AttentionLayout.APPEND_VIEWS]
    _boxes, array = kernel_params(kernel_arguments(function, layout, addresses, scale, split))
    ctypes.c_int.in_dll(kernels, "reverse_blocks").value = int(reverse)
    name, threads = KERNELS[(dtype, head_dim, wide, append is not None)]
    copies = 0 if append is None else copy_blocks(layout, threads, q.base.itemsize)
    getattr(kernels, f"run_{name}")(array, *kernel_grid(function, layout, split, copies))
    assert not counters.any()  # the last block of each row set its counter back to 0
    return split.splits


def _reference(q, k, v, bias, scale, causal) -> np.ndarray:
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    scores = q @ np.swapaxes(k, -1, -2) * scale
    if bias is not None:
        scores = scores + bias.astype(np.float64)
    if causal:
        rows, keys = scores.shape[-2:]
        visible = np.arange(keys)[None, :] <= np.arange(rows)[:, None] + keys - rows
        scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True) @ v


def _stored(x, dtype: str) -> np.ndarray:
    """Float values as the kernels' ``dtype`` holds them; bfloat16 (numpy has none) as its
    bits in uint16, rounded to nearest even as __float2bfloat16_rn."""
    if dtype != "bfloat16":
        return np.asarray(x).astype(dtype)
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _real(stored: np.ndarray, dtype: str) -> np.ndarray:
    """``_stored`` values as float64."""
    if dtype == "bfloat16":
        stored = (np.ascontiguousarray(stored).astype(np.uint32) << 16).view(np.float32)
    return stored.astype(np.float64)


def _lowest(dtype: str) -> float:
    """The dtype's lowest finite value (Hugging Face's masked keys)."""
    return -3.3895314e38 if dtype == "bfloat16" else float(np.finfo(dtype).min)


TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1e-2}

CASES = [  # dtype, head_dim, batch, heads, rows, keys, bias, causal, splits (None: the runtime's)
    ("float32", 64, 2, 3, 1, 1, False, False, None),
    ("float32", 64, 2, 3, 1, 33, True, False, None),
    ("float32", 64, 1, 2, 1, 300, True, False, 1),     # the wide kernel (16 warps)
    ("float32", 64, 1, 2, 1, 600, False, False, 1),    # wide, two tiles for some warps
    ("float32", 64, 2, 3, 1, 256, True, False, None),  # 8 warps: one tile each
    ("float32", 128, 2, 2, 1, 300, True, False, None),  # wide (no split below 513 keys)
    ("float32", 64, 1, 2, 1, 600, True, False, None),  # split over 3 blocks a row
    ("float32", 64, 1, 2, 1, 70, True, False, 8),      # splits with no key at all
    ("float32", 64, 2, 2, 3, 70, False, True, None),   # a few rows, causal
    ("float32", 64, 2, 2, 3, 300, False, True, 4),     # causal and split
    ("float32", 128, 1, 2, 2, 45, True, False, None),
    ("float32", 128, 1, 1, 1, 700, True, False, None),
    ("float16", 64, 2, 2, 1, 257, True, False, None),
    ("float16", 64, 1, 3, 4, 9, False, True, None),
    ("float16", 128, 1, 2, 1, 520, True, False, None),
    ("bfloat16", 64, 2, 3, 1, 257, True, False, None),
    ("bfloat16", 128, 2, 3, 1, 40, True, False, None),
]


def _packed_q(rng, batch: int, rows: int, width: int, head_dim: int, dtype: str):
    """A packed [batch, rows, 3 * width] qkv, and q: its first ``width`` columns as heads."""
    qkv = _stored(rng.standard_normal(batch * rows * 3 * width), dtype)
    return qkv, View(qkv, 0, rows * 3 * width, head_dim, 3 * width)


def _mask_bias(rng, batch: int, rows: int, keys: int, dtype: str,
               first_tiles_masked: bool = False) -> View:
    """A [batch, 1, rows, keys] bias: random, every fifth key masked with the dtype's lowest
    value (as Hugging Face's masks have them); ``first_tiles_masked``: every key of the
    first two warps' tiles too (-inf)."""
    values = rng.standard_normal(batch * rows * keys) * 2
    values[::5] = _lowest(dtype)
    if first_tiles_masked:
        values.reshape(batch, rows, keys)[..., :64] = -np.inf
    return View(_stored(values, dtype), 0, rows * keys, 0, keys)


@pytest.mark.parametrize("dtype,head_dim,batch,heads,rows,keys,with_bias,causal,splits", CASES)
def test_decode_attention_equals_numpy(kernels, dtype, head_dim, batch, heads, rows, keys,
                                       with_bias, causal, splits):
    rng = np.random.default_rng(keys)
    shape = (batch, heads, rows, head_dim)
    width = heads * head_dim
    # q: heads of a packed [batch, rows, 3 * width] qkv; k, v: dense [batch, heads, keys, d]
    # caches; out: [batch, rows, heads, head_dim]; bias: [batch, 1, rows, keys].
    _, q = _packed_q(rng, batch, rows, width, head_dim, dtype)
    k, v = (View(_stored(rng.standard_normal(batch * heads * keys * head_dim), dtype), 0,
                 heads * keys * head_dim, keys * head_dim, head_dim) for _ in range(2))
    bias = _mask_bias(rng, batch, rows, keys, dtype) if with_bias else None
    scale = head_dim ** -0.5
    want = _reference(*(_real(x.read(s), dtype) for x, s in (
        (q, shape), (k, (batch, heads, keys, head_dim)), (v, (batch, heads, keys, head_dim)))),
        None if bias is None else _real(bias.read((batch, heads, rows, keys)), dtype), scale,
        causal)
    for reverse in (False, True):
        flat = _stored(np.full(batch * rows * width, np.nan), dtype)
        out = View(flat, 0, rows * width, head_dim, width)
        _run(kernels, dtype, q, k, v, out, bias, shape, keys, causal, scale, reverse, splits)
        np.testing.assert_allclose(_real(out.read(shape), dtype), want,
                                   rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


APPEND_CASES = [  # dtype, head_dim, batch, heads, new rows, past, bias, causal, splits
    ("float32", 64, 2, 3, 1, 0, True, False, None),    # no past: the new row alone
    ("float32", 64, 2, 3, 1, 40, True, False, None),
    ("float32", 64, 1, 2, 1, 299, True, False, 1),     # the wide _append kernel
    ("float32", 64, 1, 2, 1, 599, False, False, None),  # split over 3 blocks a row
    ("float32", 128, 1, 2, 1, 299, True, False, None),  # wide, a head_dim of 128
    ("float32", 128, 2, 2, 1, 70, "masked", False, None),  # whole tiles masked: V still copied
    ("float32", 64, 2, 3, 1, 1000, False, False, 1),   # wide: 8 copy blocks a (batch, head)
    ("float32", 64, 2, 2, 3, 67, False, True, None),   # three new rows, causal
    ("float32", 64, 2, 2, 3, 297, True, True, 4),      # causal and split
    ("float16", 64, 2, 2, 1, 256, True, False, None),
    ("float16", 128, 1, 3, 2, 30, False, True, None),
    ("bfloat16", 64, 2, 3, 1, 299, True, False, None),
    ("bfloat16", 128, 2, 3, 1, 69, True, False, None),
]


@pytest.mark.parametrize("dtype,head_dim,batch,heads,rows,past,with_bias,causal,splits",
                         APPEND_CASES)
def test_decode_attention_appending_to_the_cache_equals_numpy(
        kernels, dtype, head_dim, batch, heads, rows, past, with_bias, causal, splits):
    """The _append kernels: the new rows of k and v heads of a packed qkv (as q), the past
    caches dense; the attention over concat(past, new) equals numpy's, and the present
    caches written equal the concatenation, every element."""
    rng = np.random.default_rng(past + rows)
    keys = past + rows
    shape = (batch, heads, rows, head_dim)
    width = heads * head_dim
    qkv, q = _packed_q(rng, batch, rows, width, head_dim, dtype)
    new = {"k_new": View(qkv, width, rows * 3 * width, head_dim, 3 * width),
           "v_new": View(qkv, 2 * width, rows * 3 * width, head_dim, 3 * width)}
    past_k, past_v = (View(_stored(rng.standard_normal(batch * heads * past * head_dim + 8),
                                   dtype), 0, heads * past * head_dim, past * head_dim,
                           head_dim) for _ in range(2))
    unset = _stored(np.full(batch * heads * keys * head_dim, np.nan), dtype)
    present = {n: View(unset.copy(), 0, heads * keys * head_dim, keys * head_dim, head_dim)
               for n in ("k_present", "v_present")}
    bias = _mask_bias(rng, batch, rows, keys, dtype, with_bias == "masked") if with_bias else None
    cache_shape = (batch, heads, past, head_dim)
    want_k, want_v = (np.concatenate([old.read(cache_shape), new[n].read(shape)], axis=2)
                      for old, n in ((past_k, "k_new"), (past_v, "v_new")))
    scale = head_dim ** -0.5
    want = _reference(_real(q.read(shape), dtype), _real(want_k, dtype), _real(want_v, dtype),
                      None if bias is None else _real(bias.read((batch, heads, rows, keys)),
                                                      dtype), scale, causal)
    for reverse in (False, True):
        for view in present.values():
            view.base[:] = unset
        out = View(_stored(np.full(batch * rows * width, np.nan), dtype), 0, rows * width,
                   head_dim, width)
        _run(kernels, dtype, q, past_k, past_v, out, bias, shape, keys, causal, scale, reverse,
             splits, {**new, **present}, past)
        np.testing.assert_allclose(_real(out.read(shape), dtype), want,
                                   rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
        full = (batch, heads, keys, head_dim)
        np.testing.assert_array_equal(present["k_present"].read(full), want_k)
        np.testing.assert_array_equal(present["v_present"].read(full), want_v)


def test_rows_with_every_key_masked_average_as_softmax_does(kernels):
    """A row whose keys all carry the dtype's lowest value: softmax gives each the same
    weight (not NaN, not zero), and so does the kernel."""
    rng = np.random.default_rng(0)
    batch, heads, rows, keys, head_dim = 1, 2, 1, 40, 64
    q = View(rng.standard_normal(heads * head_dim).astype(np.float32), 0, heads * head_dim,
             head_dim, head_dim)
    k, v = (View(rng.standard_normal(heads * keys * head_dim).astype(np.float32), 0,
                 heads * keys * head_dim, keys * head_dim, head_dim) for _ in range(2))
    bias = View(np.full(keys, np.finfo(np.float32).min, np.float32), 0, 0, 0, keys)
    out = View(np.full(heads * head_dim, np.nan, np.float32), 0, heads * head_dim, head_dim,
               head_dim)
    for splits in (1, 2):
        _run(kernels, "float32", q, k, v, out, bias, (batch, heads, rows, head_dim), keys, False,
             0.125, False, splits)
        np.testing.assert_allclose(out.read((batch, heads, rows, head_dim)),
                                   v.read((batch, heads, keys, head_dim)).astype(np.float64)
                                   .mean(axis=2, keepdims=True), rtol=1e-5, atol=1e-6)


def test_the_runtime_splits_long_rows_of_small_grids():
    """A row's keys go to several blocks, a key a thread each, only past two keys a thread
    and where the grid is small."""
    def splits(batch, heads, keys):
        view = ViewLayout(0, 0, 0, 0)
        return decode_splits(AttentionLayout(batch, heads, 1, keys, 64, *[view] * 5), THREADS)

    assert [splits(1, 12, keys) for keys in (1, 256, 512, 513, 1024, 4096)] == \
        [1, 1, 1, 3, 4, 8]
    assert splits(4, 12, 1024) == 2  # 48 rows: 96 blocks
    assert splits(8, 12, 1024) == 1  # 96 rows: a block a row fills most SMs already


@pytest.mark.parametrize("begin", [0, 256])
def test_the_q_view_fuse_attention_gives_a_decoders_sliced_q(kernels, begin):
    """The layout ``FuseAttention`` writes for q sliced out of a (b, 768) qkv product's
    columns and reshaped to heads (``decoder_q_attention``), run on the kernel at b = 3:
    equal to numpy's attention of that slice."""
    from test_fused_attention import _fused, _layout, decoder_q_attention

    batch, heads, keys, head_dim = 3, 4, 37, 64
    (call,) = _fused(decoder_q_attention(begin, heads, head_dim))
    layout = _layout(call, b=batch, s=keys)
    rng = np.random.default_rng(begin)
    qkv = rng.standard_normal((batch, 3 * heads * head_dim)).astype(np.float32)
    caches = [rng.standard_normal((batch, heads, keys, head_dim)).astype(np.float32)
              for _ in range(2)]
    q = View(qkv.reshape(-1), layout.q.offset, layout.q.batch, layout.q.head, layout.q.row)
    k, v = (View(c.reshape(-1), 0, heads * keys * head_dim, keys * head_dim, head_dim)
            for c in caches)
    flat = np.full(batch * heads * head_dim, np.nan, np.float32)
    out = View(flat, 0, heads * head_dim, head_dim, head_dim)
    shape = (batch, heads, 1, head_dim)
    _run(kernels, "float32", q, k, v, out, None, shape, keys, False, head_dim ** -0.5, False)
    sliced = qkv[:, begin:begin + heads * head_dim].reshape(shape)
    want = _reference(sliced, *caches, None, head_dim ** -0.5, False)
    np.testing.assert_allclose(out.read(shape), want, rtol=2e-5, atol=2e-5)


def test_the_wide_kernel_takes_long_unsplit_fp32_rows_alone():
    """``runs_wide``: fp32 rows of more keys than a block's threads that do not split; fp16
    (slower with more warps on the H200) and split rows keep the usual kernel."""
    def layout(keys):
        view = ViewLayout(0, 0, 0, 0)
        return AttentionLayout(1, 12, 1, keys, 64, *[view] * 5)

    assert [runs_wide(layout(k), "float32", THREADS, 1) for k in (255, 256, 257, 1024)] == \
        [False, False, True, True]
    assert not runs_wide(layout(300), "float16", THREADS, 1)
    assert not runs_wide(layout(1024), "float32", THREADS, 4)
