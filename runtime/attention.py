"""Fused attention for the calls ``passes.FuseAttention`` makes, captured into grape's graphs.

The compiler rewrites ``softmax(q @ k^T * scale + bias) @ v`` over 16-bit tensors into
``R.call_dps_packed("grape.attention.fused...", (q, k, v, [bias], layout, scale), out)``
(``ATTENTION_FUNCTIONS``: the name says whether a bias is read and whether the attention is
causal). q, k, v and out are strided views of the tensors passed (GPT-2's q, k and v are
slices of one [batch, seq, 3 * width] tensor, read in place, and its output goes straight
into [batch, seq, heads, head_dim]); ``AttentionLayout`` says where each view's rows are, as
one shape argument whose symbolic entries TVM's VM evaluates at each call. The function
launches ``runtime/kernels/attention.cu`` on the stream TVM is capturing: a kernel node like
any other, re-pointed and re-shaped by the patch kernel in topology graphs.

No score matrix is written. On the H200, GPT-2's fp16 prefill at 1024 tokens ran its kernels
in 1445 us with it, 2107 without (ncu; bench/results/gpt2_prefill_kernels.fp16_1024.json and
its ``.split_lm_head`` predecessor); the kernel itself takes 2.2x FlashAttention-2's time
there (bench/results/attention_kernel.json).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Sequence

from .active import ThreadInstances, register_once
from .cuda_compile import CubinStore, RuntimeKernel, kernel_params
from .cuda_driver import check, driver
from .signature import nbytes

LIBRARY = "attention"  # its name in a plan's "libraries" (what the runtime must provide)
FUNCTION_PREFIX = f"grape.{LIBRARY}."
SOURCE = Path(__file__).with_name("kernels") / "attention.cu"
ROWS_PER_BLOCK = 64  # kRows of attention.cu
THREADS = 128  # kWarps * 32
HEAD_DIMS = (64, 128)  # the kernels compiled (GRAPE_ATTENTION instances)
DTYPES = {"float16": "f16", "bfloat16": "bf16"}
ALIGN_ELEMENTS = 8  # every stride and offset: the kernel loads 16 bytes at a time


@dataclass(frozen=True)
class AttentionFunction:
    """What one packed function does: add a bias tensor [b, h, rows, keys] (a dim of 1
    broadcast) to the scaled scores, and mask keys after row i + keys - rows (causal)."""

    bias: bool
    causal: bool

    @property
    def name(self) -> str:
        return FUNCTION_PREFIX + "_".join(
            p for p in ("fused", "causal" if self.causal else "", "bias" if self.bias else "") if p)


ATTENTION_FUNCTIONS = {f.name: f for f in (AttentionFunction(b, c) for b in (False, True)
                                           for c in (False, True))}


@dataclass(frozen=True)
class ViewLayout:
    """Where a [batch, heads, rows, head_dim] view lies in the tensor passed, in elements:
    row r of head h of batch b starts at offset + b * batch + h * head + r * row."""

    offset: Any
    batch: Any
    head: Any
    row: Any


@dataclass(frozen=True)
class AttentionLayout:
    """The problem's sizes and its views, passed to the packed function as one shape: the
    compiler builds it from expressions of the model's dims (``to_shape``), the runtime reads
    the values (``from_shape``)."""

    batch: Any
    heads: Any
    rows: Any  # query rows
    keys: Any
    head_dim: Any
    q: ViewLayout
    k: ViewLayout
    v: ViewLayout
    out: ViewLayout
    bias: ViewLayout  # all 0 without a bias

    VIEWS = ("q", "k", "v", "out", "bias")
    SIZES = ("batch", "heads", "rows", "keys", "head_dim")

    def to_shape(self) -> list:
        values = [getattr(self, n) for n in self.SIZES]
        for view in self.VIEWS:
            values += [getattr(getattr(self, view), f.name) for f in fields(ViewLayout)]
        return values

    @classmethod
    def from_shape(cls, values: Sequence[int]) -> "AttentionLayout":
        values = [int(v) for v in values]
        sizes = dict(zip(cls.SIZES, values))
        per_view = len(fields(ViewLayout))
        views = {}
        for i, view in enumerate(cls.VIEWS):
            start = len(cls.SIZES) + i * per_view
            views[view] = ViewLayout(*values[start:start + per_view])
        return cls(**sizes, **views)


class FusedAttention:
    """The attention kernels, loaded once (one CUmodule, owned: ``close`` unloads it); one
    per backend. ``active`` makes it the one the packed functions use."""

    def __init__(self, store: CubinStore):
        self._kernel = RuntimeKernel(store, SOURCE, f"grape_attention_f16_d{HEAD_DIMS[0]}")
        self._functions: dict[str, Any] = {}

    def function(self, dtype: str, head_dim: int):
        name = f"grape_attention_{DTYPES[dtype]}_d{head_dim}"
        if name not in self._functions:
            self._functions[name] = check(
                driver.cuModuleGetFunction(self._kernel.module, name.encode()),
                f"cuModuleGetFunction({name})")
        return self._functions[name]

    def launch(self, function: AttentionFunction, q, k, v, bias, out, layout: AttentionLayout,
               scale: float, stream: int) -> None:
        """One launch on ``stream``: q, k, v, bias and out are the tensors passed."""
        dtype = str(out.dtype)
        if dtype not in DTYPES or layout.head_dim not in HEAD_DIMS:
            raise ValueError(f"{function.name}: no kernel for {dtype} with head_dim "
                             f"{layout.head_dim} (kernels: {sorted(DTYPES)}, {HEAD_DIMS})")
        if layout.batch == 0 or layout.rows == 0:
            return
        if layout.keys == 0:  # a weighted sum over no keys: zeros, as the unfused product
            check(driver.cuMemsetD8Async(out.data_ptr(), 0, nbytes(out), stream),
                  "cuMemsetD8Async")
            return
        size = 2  # bytes of a 16-bit element
        q_at, k_at, v_at = (t.data_ptr() + getattr(layout, n).offset * size
                            for t, n in ((q, "q"), (k, "k"), (v, "v")))
        if (q_at | k_at | v_at) % 16:
            raise ValueError(f"{function.name}: q, k and v must start on 16 bytes "
                             f"(at {q_at:#x}, {k_at:#x}, {v_at:#x})")
        values = [("u64", q_at), ("u64", k_at), ("u64", v_at),
                  ("u64", 0 if bias is None else bias.data_ptr() + layout.bias.offset * size),
                  ("u64", out.data_ptr() + layout.out.offset * size),
                  ("i32", layout.rows), ("i32", layout.keys), ("i32", int(function.causal))]
        for view in AttentionLayout.VIEWS:
            strides = getattr(layout, view)
            values += [("i64", strides.batch), ("i64", strides.head), ("i64", strides.row)]
        values.append(("f32", scale))
        storage = kernel_params(values)  # alive until launched
        grid = (-(-layout.rows // ROWS_PER_BLOCK), layout.heads, layout.batch)
        check(driver.cuLaunchKernel(self.function(dtype, layout.head_dim), *grid, THREADS, 1, 1,
                                    0, stream, ctypes.addressof(storage[1]), 0),
              "cuLaunchKernel(grape_attention)")

    def active(self):
        """Calls of the packed functions on this thread use this instance meanwhile."""
        return _INSTANCES.activated(self)

    def close(self) -> None:
        self._functions.clear()
        self._kernel.close()


class _InstalledStore:
    """The cubin of a source from the compiler TVM calls for its own CUDA source
    (``tvm_callback_cuda_compile``: the store the loader installed, with the artifact's
    cubins, else TVM's own, nvrtc)."""

    def lookup(self, code: str) -> bytes:
        import tvm  # pylint: disable=import-outside-toplevel

        return bytes(tvm.get_global_func("tvm_callback_cuda_compile")(code))


# The FusedAttention a packed function call on this thread uses.
_INSTANCES = ThreadInstances(lambda _device_index: FusedAttention(_InstalledStore()))


def _packed(function: AttentionFunction):
    """The body of packed function ``function.name``: TVM's VM passes q, k, v, the bias if
    any, the layout shape and the scale, then the output (destination passing)."""
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    def call(*args: Any) -> None:
        q, k, v, *rest, shape, scale, out = args
        bias = rest[0] if function.bias else None
        stream = tvm_ffi.get_raw_stream(out.device)
        _INSTANCES.current(out.device.index).launch(
            function, q, k, v, bias, out, AttentionLayout.from_shape(shape), float(scale),
            int(stream or 0))

    return call


def register_functions() -> None:
    """Register every ``ATTENTION_FUNCTIONS`` entry with TVM (idempotent)."""
    register_once(ATTENTION_FUNCTIONS, _packed)
