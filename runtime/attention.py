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

A query of fewer than ``DECODE_ROWS`` rows (a decode step's one), fp32 included, runs
``runtime/kernels/decode_attention.cu`` instead (``grape.decode_attention.*``): a block per
query row reads each key and value row once. Its ``*_append`` functions also append the
step's new keys and values to the cache: they read the past cache and the new rows where
they are, and blocks of their own (``copy_blocks``) write the present caches (``(out,
k_present, v_present)``), which the model's ``concat`` would otherwise copy in kernels of its
own.

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
from .signature import nbytes, nbytes_of

LIBRARY = "attention"  # its name in a plan's "libraries" (what the runtime must provide)
DECODE_LIBRARY = "decode_attention"
FUNCTION_PREFIX = f"grape.{LIBRARY}."
DECODE_FUNCTION_PREFIX = f"grape.{DECODE_LIBRARY}."
SOURCE = Path(__file__).with_name("kernels") / "attention.cu"
DECODE_SOURCE = Path(__file__).with_name("kernels") / "decode_attention.cu"
SOURCE_OF = {LIBRARY: SOURCE, DECODE_LIBRARY: DECODE_SOURCE}  # each library's kernels


def sources_of(libraries) -> list[Path]:
    """The kernel sources of the attention libraries among a plan's ``libraries``."""
    return [SOURCE_OF[library] for library in libraries if library in SOURCE_OF]

ROWS_PER_BLOCK = 64  # kRows of attention.cu
# Queries of fewer rows run the decode kernel: attention.cu's blocks of 64 rows would be
# mostly idle, and its tensor-core tiles need 16-bit operands.
DECODE_ROWS = ROWS_PER_BLOCK // 4
# The kernels compiled (GRAPE_ATTENTION, GRAPE_DECODE_ATTENTION_BOTH instances).
HEAD_DIMS = (64, 128)
DTYPES = {"float16": "f16", "bfloat16": "bf16"}
DECODE_DTYPES = {"float32": "f32", **DTYPES}
ALIGN_ELEMENTS = 8  # every stride and offset: the kernels load 16 bytes at a time
# The decode kernel splits a row of more than SPLIT_AFTER keys a thread over up to
# MAX_SPLITS blocks, a key a thread each, where its grid would fill few SMs (at most
# SPLIT_BLOCKS blocks), combining them through a workspace of SPLIT_ROWS (batch, head, row)
# entries. On the H200 a split costs about 2 us and a block's round of 256 keys 1.4 (fp16)
# to 2.5 (fp32) at batch 1: splitting 257 keys was slower; 513 faster in fp32 and slower in
# fp16; 1024 faster in both (bench/results/decode_attention.1e3b04f.json).
MAX_SPLITS = 8
SPLIT_AFTER = 2
# A row the decode kernel does not split, of more keys than its block's threads, runs its
# _wide kernel (twice the warps: one round of keys where the block would take two) in these
# dtypes. On the H200, fp32, head_dim 64 (bench/results/decode_attention.1e3b04f.json, against its
# variant no_wide): 257 keys 5.27 against 6.15 us at batch 1 and 6.09 against 6.91 at batch
# 8, 1024 keys at batch 8 14.61 against 17.04; in fp16 a build of 16 warps was slower at most
# sizes (decode_attention.4f9ad6e.json, variant w16).
WIDE_DECODE_DTYPES = ("float32",)
SPLIT_BLOCKS = 128  # about the H200's 132 SMs: a split's combine costs more than a wave
# The rows each thread of an _append kernel's copy block copies, of keys and of values
# (kCopyPasses of decode_attention.cu), every load in flight before its stores.
COPY_PASSES = 4
SPLIT_ROWS = SPLIT_BLOCKS // 2  # the most rows that split (in two, at least)
_SPLIT_PARTIAL_BYTES = SPLIT_ROWS * MAX_SPLITS * (max(HEAD_DIMS) + 2) * 4  # acc, max, sum
_SPLIT_COUNTER_BYTES = SPLIT_ROWS * 4


@dataclass(frozen=True)
class AttentionFunction:
    """What one packed function does: add a bias tensor [b, h, rows, keys] (a dim of 1
    broadcast) to the scaled scores, and mask keys after row i + keys - rows (causal);
    ``decode``: a query of fewer than ``DECODE_ROWS`` rows, on the decode kernel (library
    ``decode_attention``)."""

    bias: bool
    causal: bool
    decode: bool = False
    append: bool = False  # decode only: k and v are the past caches, the new rows appended

    def __post_init__(self):
        if self.append and not self.decode:
            raise ValueError("only the decode kernel appends to a cache")

    @property
    def name(self) -> str:
        prefix = DECODE_FUNCTION_PREFIX if self.decode else FUNCTION_PREFIX
        return prefix + "_".join(
            p for p in ("fused", "causal" if self.causal else "", "bias" if self.bias else "",
                        "append" if self.append else "") if p)

    @property
    def dtypes(self) -> dict[str, str]:
        """The dtypes its kernels take, with their names in the kernels' names."""
        return DECODE_DTYPES if self.decode else DTYPES

    def kernel(self, dtype: str, head_dim: int, wide: bool = False) -> str:
        """The name of its kernel for ``dtype`` and ``head_dim`` (``wide``: the decode
        kernel's of twice the warps, ``WIDE_DECODE_DTYPES``)."""
        kind = DECODE_LIBRARY if self.decode else LIBRARY
        return f"grape_{kind}_{self.dtypes[dtype]}_d{head_dim}" + ("_wide" if wide else "") + \
            ("_append" if self.append else "")


ATTENTION_FUNCTIONS = {f.name: f for f in (
    AttentionFunction(b, c, d, a) for b in (False, True) for c in (False, True)
    for d in (False, True) for a in ((False, True) if d else (False,)))}
_FIRST_KERNEL = {  # the kernel loading a source looks up, a check that it is the right one
    SOURCE: AttentionFunction(False, False).kernel("float16", HEAD_DIMS[0]),
    DECODE_SOURCE: AttentionFunction(False, False, decode=True).kernel("float32", HEAD_DIMS[0])}


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
    k: ViewLayout  # appending: the past cache's, ``past`` rows (``keys`` counts the new too)
    v: ViewLayout
    out: ViewLayout
    bias: ViewLayout  # all 0 without a bias
    # Appending (``AttentionFunction.append``): the past's rows, where the new rows are, and
    # where the present caches (keys rows each) are written; else None.
    past: Any = None
    k_new: ViewLayout | None = None
    v_new: ViewLayout | None = None
    k_present: ViewLayout | None = None
    v_present: ViewLayout | None = None

    VIEWS = ("q", "k", "v", "out", "bias")
    SIZES = ("batch", "heads", "rows", "keys", "head_dim")
    APPEND_VIEWS = ("k_new", "v_new", "k_present", "v_present")

    @property
    def appends(self) -> bool:
        return self.past is not None

    def to_shape(self) -> list:
        values = [getattr(self, n) for n in self.SIZES]
        views = self.VIEWS + (self.APPEND_VIEWS if self.appends else ())
        if self.appends:
            values.append(self.past)
        for view in views:
            values += [getattr(getattr(self, view), f.name) for f in fields(ViewLayout)]
        return values

    @classmethod
    def from_shape(cls, values: Sequence[int]) -> "AttentionLayout":
        values = [int(v) for v in values]
        sizes = dict(zip(cls.SIZES, values))
        per_view = len(fields(ViewLayout))
        start = len(cls.SIZES)
        plain = start + per_view * len(cls.VIEWS)
        appending = plain + 1 + per_view * len(cls.APPEND_VIEWS)
        views = cls.VIEWS
        if len(values) == appending:
            sizes["past"] = values[start]
            start += 1
            views += cls.APPEND_VIEWS
        elif len(values) != plain:
            raise ValueError(f"an attention layout of {len(values)} values: expected {plain}, "
                             f"or {appending} appending")
        found = {}
        for i, view in enumerate(views):
            at = start + i * per_view
            found[view] = ViewLayout(*values[at:at + per_view])
        return cls(**sizes, **found)


@dataclass(frozen=True)
class CacheTensors:
    """The tensors an _append function reads and writes besides q, k, v, bias and out: the
    step's new rows, and the present caches it writes (``AttentionLayout.APPEND_VIEWS``)."""

    k_new: Any
    v_new: Any
    k_present: Any
    v_present: Any


@dataclass(frozen=True)
class KeySplit:
    """How the decode kernel splits a row's keys over blocks: ``splits`` blocks a row (1: no
    split), their partial results left at ``partials``, counted at ``counters``."""

    splits: int
    partials: int = 0  # device addresses
    counters: int = 0


def decode_splits(layout: AttentionLayout, threads: int, split_after: int = SPLIT_AFTER,
                  max_splits: int = MAX_SPLITS) -> int:
    """Blocks a row of the decode kernel takes: one up to ``split_after`` keys a thread, else
    a key a thread each, up to ``max_splits``, while the grid stays within ``SPLIT_BLOCKS``
    and the workspace holds its rows."""
    rows = layout.batch * layout.heads * layout.rows
    if rows > SPLIT_ROWS or layout.keys <= threads * split_after:
        return 1
    return max(1, min(max_splits, -(-layout.keys // threads), SPLIT_BLOCKS // rows))


def runs_wide(layout: AttentionLayout, dtype: str, threads: int, splits: int,
              dtypes: Sequence[str] = WIDE_DECODE_DTYPES) -> bool:
    """Whether a decode launch takes the _wide kernel: a row it does not split, of more
    keys than the ``threads`` of a block of the usual kernel, in ``dtypes``."""
    return dtype in dtypes and splits == 1 and layout.keys > threads


def copy_blocks(layout: AttentionLayout, threads: int, itemsize: int) -> int:
    """The blocks along x an _append launch adds to copy the caches: ``COPY_PASSES`` rows
    of ``threads`` a (batch, head) each, a row ``head_dim * itemsize / 16`` threads."""
    rows = COPY_PASSES * threads * 16 // (layout.head_dim * itemsize)
    return -(-layout.keys // rows)


def kernel_arguments(function: AttentionFunction, layout: AttentionLayout,
                     addresses: Sequence[int], scale: float, split: KeySplit | None = None
                     ) -> list[tuple[str, Any]]:
    """The kernel's parameters as ``(kind, value)`` (``cuda_compile.kernel_params``):
    ``addresses`` those of q, k, v, the bias (0 without) and out, each at its view's
    offset (appending, then k_new, v_new, k_present and v_present); the decode kernel's
    ``split``, then what an _append kernel reads of the cache, last."""
    values = [("u64", address) for address in addresses[:5]]
    values += [("i32", layout.rows), ("i32", layout.keys), ("i32", int(function.causal))]
    values += _strides(layout, AttentionLayout.VIEWS)
    values.append(("f32", scale))
    if function.decode:
        values += [("u64", split.partials), ("u64", split.counters), ("i32", split.splits)]
    if function.append:
        values += [("u64", address) for address in addresses[5:]]
        values.append(("i32", layout.past))
        values += _strides(layout, AttentionLayout.APPEND_VIEWS)
    return values


def _strides(layout: AttentionLayout, views: Sequence[str]) -> list[tuple[str, int]]:
    """The batch, head and row strides of each of ``views``, as kernel parameters."""
    out = []
    for view in views:
        strides = getattr(layout, view)
        out += [("i64", strides.batch), ("i64", strides.head), ("i64", strides.row)]
    return out


def kernel_grid(function: AttentionFunction, layout: AttentionLayout,
                split: KeySplit | None = None, copies: int = 0) -> tuple[int, int, int]:
    """The kernel's grid: blocks of 64 query rows, or (decode) a block per row and split,
    then (appending) ``copies`` copy blocks (``copy_blocks``), for each (head, batch)."""
    if function.decode:
        return layout.rows * split.splits + copies, layout.heads, layout.batch
    return -(-layout.rows // ROWS_PER_BLOCK), layout.heads, layout.batch


class FusedAttention:
    """The attention kernels, loaded once (a CUmodule per source, owned: ``close`` unloads
    them, and frees the decode kernel's workspace); one per backend. ``active`` makes it the
    one the packed functions use. ``sources``: those to load now (a backend's, before any
    capture); any other is loaded on first use (TVM's VM on the library). ``split_after``
    and ``max_splits``: the decode kernel's split of long rows (``decode_splits``). The split
    workspace is one per instance: its launches must not run at once, as a backend's do not
    (its calls and graphs run in order on its one stream). ``wide_dtypes``: those whose long
    unsplit rows take the _wide kernel (``runs_wide``)."""

    def __init__(self, store: CubinStore, sources: Sequence[Path] = (), *,
                 split_after: int = SPLIT_AFTER, max_splits: int = MAX_SPLITS,
                 wide_dtypes: Sequence[str] = WIDE_DECODE_DTYPES):
        if not 1 <= max_splits <= MAX_SPLITS:  # the workspace holds MAX_SPLITS a row
            raise ValueError(f"max_splits must be 1 to {MAX_SPLITS}, got {max_splits}")
        self._store = store
        self.split_after, self.max_splits = split_after, max_splits
        self.wide_dtypes = tuple(wide_dtypes)
        self._kernels: dict[Path, RuntimeKernel] = {}
        self._functions: dict[str, tuple[Any, int]] = {}  # name -> (CUfunction, threads)
        self._workspace = 0
        try:
            for source in sources:
                self._kernel(source)
        except BaseException:
            self.close()
            raise

    def _kernel(self, source: Path) -> RuntimeKernel:
        if source not in self._kernels:
            self._kernels[source] = RuntimeKernel(self._store, source, _FIRST_KERNEL[source])
            if source == DECODE_SOURCE:
                self._workspace = self._decode_workspace()
        return self._kernels[source]

    @staticmethod
    def _decode_workspace() -> int:
        """The decode kernel's split workspace: partial results, then counters (zeroed: the
        kernel leaves them at 0 after each row it combines)."""
        workspace = check(driver.cuMemAlloc(_SPLIT_PARTIAL_BYTES + _SPLIT_COUNTER_BYTES),
                          "cuMemAlloc(decode attention workspace)")
        check(driver.cuMemsetD8(int(workspace) + _SPLIT_PARTIAL_BYTES, 0, _SPLIT_COUNTER_BYTES),
              "cuMemsetD8")
        check(driver.cuCtxSynchronize(), "cuCtxSynchronize")  # zeroed before any launch reads
        return int(workspace)

    def function(self, function: AttentionFunction, dtype: str, head_dim: int,
                 wide: bool = False) -> tuple[Any, int]:
        """The CUfunction of ``function``'s kernel and its threads a block (the kernel's own
        ``__launch_bounds__``)."""
        name = function.kernel(dtype, head_dim, wide)
        if name not in self._functions:
            module = self._kernel(DECODE_SOURCE if function.decode else SOURCE).module
            handle = check(driver.cuModuleGetFunction(module, name.encode()),
                           f"cuModuleGetFunction({name})")
            # The kernels' __launch_bounds__ are their blocks (kWarps * 32, WARPS * 32):
            # the most threads the driver allows a block is the block they need.
            threads = check(driver.cuFuncGetAttribute(
                driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, handle),
                "cuFuncGetAttribute")
            if threads % 32:
                raise ValueError(f"{name}: a block of {threads} threads is not whole warps")
            self._functions[name] = (handle, threads)
        return self._functions[name]

    def launch(self, function: AttentionFunction, q, k, v, bias, out, layout: AttentionLayout,
               scale: float, stream: int, appended: CacheTensors | None = None) -> None:
        """One launch on ``stream``: q, k, v, bias and out are the tensors passed;
        ``appended`` those an _append function reads and writes besides."""
        dtype = str(out.dtype)
        if dtype not in function.dtypes or layout.head_dim not in HEAD_DIMS:
            raise ValueError(f"{function.name}: no kernel for {dtype} with head_dim "
                             f"{layout.head_dim} (kernels: {sorted(function.dtypes)}, "
                             f"{HEAD_DIMS})")
        if function.append != (appended is not None) or function.append != layout.appends:
            raise ValueError(f"{function.name}: the cache's tensors and layout are passed "
                             "to the _append functions, and only to them")
        if layout.appends and not 0 <= layout.past <= layout.keys:
            raise ValueError(f"{function.name}: a past of {layout.past} rows for "
                             f"{layout.keys} keys")
        if layout.batch == 0 or layout.rows == 0:
            return
        if layout.keys == 0:  # a weighted sum over no keys: zeros, as the unfused product
            check(driver.cuMemsetD8Async(out.data_ptr(), 0, nbytes(out), stream),
                  "cuMemsetD8Async")
            return
        size = nbytes_of((), dtype)  # an element's
        read = [(q, "q"), (k, "k"), (v, "v")]
        if appended is not None:
            read += [(getattr(appended, n), n) for n in AttentionLayout.APPEND_VIEWS]
        at = [t.data_ptr() + getattr(layout, n).offset * size for t, n in read]
        misaligned = [f"{n} at {a:#x}" for (_, n), a in zip(read, at) if a % 16]
        if misaligned:
            raise ValueError(f"{function.name}: every view must start on 16 bytes "
                             f"({', '.join(misaligned)})")
        handle, threads = self.function(function, dtype, layout.head_dim)
        split = None
        if function.decode:
            splits = decode_splits(layout, threads, self.split_after, self.max_splits)
            split = KeySplit(splits, self._workspace,
                             self._workspace + _SPLIT_PARTIAL_BYTES)
            if runs_wide(layout, dtype, threads, splits, self.wide_dtypes):
                handle, threads = self.function(function, dtype, layout.head_dim, wide=True)
        addresses = (*at[:3], 0 if bias is None else bias.data_ptr() + layout.bias.offset * size,
                     out.data_ptr() + layout.out.offset * size, *at[3:])
        storage = kernel_params(kernel_arguments(function, layout, addresses, scale, split))
        copies = copy_blocks(layout, threads, size) if function.append else 0
        check(driver.cuLaunchKernel(handle, *kernel_grid(function, layout, split, copies),
                                    threads, 1, 1, 0, stream, ctypes.addressof(storage[1]), 0),
              f"cuLaunchKernel({function.name})")

    def active(self):
        """Calls of the packed functions on this thread use this instance meanwhile."""
        return _INSTANCES.activated(self)

    def close(self) -> None:
        self._functions.clear()
        for kernel in self._kernels.values():
            kernel.close()
        self._kernels.clear()
        if self._workspace:
            driver.cuMemFree(self._workspace)
            self._workspace = 0


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
    """The body of packed function ``function.name``: TVM's VM passes q, k, v (appending:
    the past caches, then k_new and v_new), the bias if any, the layout shape and the
    scale, then the outputs (destination passing: out; appending, then k_present and
    v_present)."""
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    def call(*args: Any) -> None:
        appended = None
        if function.append:
            q, k, v, k_new, v_new, *rest, shape, scale, out, k_present, v_present = args
            appended = CacheTensors(k_new, v_new, k_present, v_present)
        else:
            q, k, v, *rest, shape, scale, out = args
        bias = rest[0] if function.bias else None
        stream = tvm_ffi.get_raw_stream(out.device)
        _INSTANCES.current(out.device.index).launch(
            function, q, k, v, bias, out, AttentionLayout.from_shape(shape), float(scale),
            int(stream or 0), appended)

    return call


def register_functions() -> None:
    """Register every ``ATTENTION_FUNCTIONS`` entry (both libraries') with TVM (idempotent)."""
    register_once(ATTENTION_FUNCTIONS, _packed)
