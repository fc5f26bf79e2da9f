"""32-bit index arithmetic in the GPU kernels whose every buffer stays below 2^31 elements
over the declared ranges."""

from __future__ import annotations

from typing import Mapping

import tvm
from tvm import IRModule, relax, s_tir, tirx
from tvm.ir import Range
from tvm.ir.expr import TensorLoad
from tvm.ir.transform import PassContext, module_pass
from tvm.sym import Analyzer
from tvm_ffi.structural import structural_walk

from .few_rows_gemv import LIBRARY_FUNCTION_ATTR

INT32_ELEMENTS = 2 ** 31 - 1  # the largest element offset a 32-bit index holds


def _buffers(func: tirx.PrimFunc) -> list[tirx.Buffer]:
    """Every buffer ``func`` takes, allocates, reads or writes (a parameter it never reads
    counts: ForceNarrowIndexToInt32 refuses a 64-bit one all the same)."""
    found: dict[int, tirx.Buffer] = {id(p): p for p in func.params
                                     if isinstance(p.ty, tirx.BufferType)}

    def on_block(block):
        for buffer in block.alloc_buffers:
            found[id(buffer)] = buffer

    def on_store(node):
        found[id(node.buffer)] = node.buffer

    def on_load(node):
        found[id(node.source)] = node.source

    def on_alloc(node):
        found[id(node.buffer)] = node.buffer

    structural_walk(func.body, ((s_tir.SBlock, on_block), (tirx.BufferStore, on_store),
                                (TensorLoad, on_load), (tirx.AllocBuffer, on_alloc)))
    return list(found.values())


def _calls_packed(func: tirx.PrimFunc) -> bool:
    found = []

    def on_call(call):
        if isinstance(call.op, tvm.ir.Op) and "call_packed" in call.op.name:
            found.append(call)

    structural_walk(func.body, ((tvm.ir.Call, on_call),))
    return bool(found)


def largest_offset(func: tirx.PrimFunc, upper: Mapping[str, int]) -> int | None:
    """The most elements any buffer of ``func`` holds with its symbolic dims (by name) at
    most ``upper``, or None where a dim has no upper bound there."""
    analyzer = Analyzer()
    free: dict[str, tirx.Var] = {}
    for buffer in _buffers(func):
        for dim in buffer.shape:
            for var in tirx.analysis.undefined_vars(dim) if not isinstance(dim, tirx.IntImm) else ():
                free[var.name] = var
    for name, var in free.items():
        if name not in upper:
            return None
        analyzer.bind(var, Range.from_min_extent(tirx.const(0, var.ty),
                                                 tirx.const(int(upper[name]) + 1, var.ty)))
    largest = 0
    for buffer in _buffers(func):
        elements = tirx.const(1, "int64")
        for dim in buffer.shape:
            elements = elements * tirx.Cast("int64", dim)
        bound = analyzer.const_int_bound(analyzer.simplify(elements))
        if bound.max_value >= bound.POS_INF:
            return None
        largest = max(largest, int(bound.max_value))
    return largest


@module_pass(opt_level=0, name="NarrowIndices")
class NarrowIndices:
    """Rewrite a GPU kernel's 64-bit index arithmetic as 32-bit (TVM's
    ``ForceNarrowIndexToInt32``) where no buffer it touches holds more than 2^31 - 1
    elements at the upper bounds of its dims (``tir_var_upper_bound``): symbolic dims are int64 in Relax,
    so every index of a kernel over them is computed in 64 bits, which a GPU does in
    several 32-bit instructions. On the H200, GPT-2's fp16 prefill at 1024 tokens: its fused
    scale, mask and softmax (issue-bound, its ALU pipe the busiest:
    bench/results/softmax_ncu.fp16_1024.txt) took 51.5 us a call with this pass against
    55.2 without, the prefill 2540 us against 2601 (one run, bench/README.md, "Session of
    2026-12-02, third"). Functions that call packed
    functions (a library dispatch) are left alone, as are kernels over a dim without a
    declared range.

    Before (``seq`` in 1..1024, ``batch`` in 1..4)::

        for ax3_fused_0 in range((seq + T.int64(31)) // T.int64(32)):
            ... lv43[((ax3_fused_0 * T.int64(32) + blockIdx.y * seq * seq) + ...]

    After::

        for ax3_fused_0 in range((seq + 31) // 32):     # seq: T.int32 here
            ... lv43[((ax3_fused_0 * 32 + blockIdx.y * seq * seq) + ...]
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        upper = upper_bounds(mod)
        narrowed = {}
        for gvar, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc) or not narrows(func, upper):
                continue
            single = tirx.transform.ForceNarrowIndexToInt32()(IRModule({gvar: func}))
            narrowed[gvar] = single[gvar]
        for gvar, func in narrowed.items():
            mod[gvar] = func
        return mod


def upper_bounds(mod: IRModule) -> dict[str, int]:
    """The upper bound of each symbolic dim, by name, from the Relax functions'
    ``tir_var_upper_bound`` (``BoundShapeRanges`` writes it from the declared ranges)."""
    upper: dict[str, int] = {}
    for func in mod.functions.values():
        if isinstance(func, relax.Function) and func.attrs is not None and \
                "tir_var_upper_bound" in func.attrs:
            for name, bound in func.attrs["tir_var_upper_bound"].items():
                upper[str(name)] = max(upper.get(str(name), 0), int(bound))
    return upper


def narrows(func: tirx.PrimFunc, upper: Mapping[str, int]) -> bool:
    """Whether ``func`` is a kernel whose buffers all hold at most 2^31 - 1 elements with
    its dims at most ``upper``, none of 64-bit integers; not a library dispatch (a packed
    call)."""
    if func.attrs is not None and LIBRARY_FUNCTION_ATTR in func.attrs:
        return False
    if _calls_packed(func):
        return False
    if any(str(buffer.dtype) == "int64" for buffer in _buffers(func)):
        return False  # 64-bit data (positions, token ids): ForceNarrowIndexToInt32 refuses it
    largest = largest_offset(func, upper)
    return largest is not None and largest <= INT32_ELEMENTS
