"""``NarrowIndices`` (passes/narrow_indices.py) on tiny modules: which kernels get 32-bit
indices (every buffer below 2^31 elements at the dims' upper bounds), which keep 64-bit
ones, and that a narrowed kernel computes what the 64-bit one does at several shapes (on
llvm: the rewrite is TVM's ``ForceNarrowIndexToInt32``, target-independent)."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax, tirx

import grape_tvm

from grape_tvm.passes import NarrowIndices
from grape_tvm.passes.narrow_indices import largest_offset, narrows
from test_passes import fused_kernel_of
from test_row_reduction import attention_probabilities, masked_softmax_equals_numpy

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


def _softmax_of_scores(dtype: str = "float32") -> tirx.PrimFunc:
    """GPT-2's attention probabilities over (b, 12, s, s), one kernel."""
    make, *types = attention_probabilities(dtype)
    return fused_kernel_of(make, *types)


def _index_dtypes(func: tirx.PrimFunc) -> set[str]:
    """The dtypes of the function's symbolic dims (the variables of its buffer shapes)."""
    return {str(var.ty.dtype) for var in tirx.analysis.undefined_vars(func.body)
            if isinstance(var.ty, tvm.ir.PrimType)}


def test_the_largest_buffer_at_the_upper_bounds():
    func = _softmax_of_scores()
    assert largest_offset(func, {"b": 4, "s": 1024}) == 4 * 12 * 1024 * 1024
    assert largest_offset(func, {"b": 4}) is None  # s has no bound: no answer


@pytest.mark.parametrize("upper, narrowed", [
    ({"b": 4, "s": 1024}, True),    # 50 M elements
    ({"b": 4, "s": 4096}, True),    # 805 M
    ({"b": 4, "s": 8192}, False),   # 3.2 G: past 2^31
    ({"b": 4}, False),              # s unbounded
])
def test_a_kernel_narrows_only_where_its_buffers_fit_32_bits(upper, narrowed):
    assert narrows(_softmax_of_scores(), upper) == narrowed


def test_a_kernel_of_64_bit_data_keeps_its_indices():
    """Position ids are int64: TVM's rewrite refuses such buffers."""
    s = tirx.Var("s", "int64")
    func = fused_kernel_of(lambda x: relax.op.add(x, relax.const(1, "int64")),
                           relax.TensorType((1, s), "int64"))
    assert not narrows(func, {"s": 1024})


def test_a_kernel_taking_64_bit_data_it_never_reads_keeps_its_indices():
    """A gather of a table broadcast from one row, fused with the broadcast
    (``FuseGathers``): every row is the same, so the kernel never reads its int64 indices,
    a parameter still. TVM's rewrite refuses the parameter all the same (it failed the CUDA
    build before)."""
    b = tirx.Var("b", "int64")
    row = relax.Var("row", relax.TensorType((6,), "float32"))
    index = relax.Var("index", relax.TensorType((b,), "int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [row, index]):
        with bb.dataflow():
            table = relax.op.broadcast_to(row, (10, 6))
            y = bb.emit_output(relax.op.add(relax.op.take(table, index, axis=0),
                                            relax.const(1.0, "float32")))
        bb.emit_func_output(y)
    module = grape_tvm.build(bb.get(), {"b": (1, 8)}, CUDA, output_names=["y"],
                             prebuild_cubin=False)
    (kernel,) = [k for r in module.plan["regions"] for k in r["kernels"]]
    assert "take" in kernel and "broadcast_to" in kernel, kernel


def _module(func: tirx.PrimFunc, upper: dict[str, int]) -> tvm.IRModule:
    """``func`` beside a Relax function declaring ``upper``, as the pipeline has them."""
    main = relax.Function([], relax.Tuple([]), relax.TupleType([]))
    main = main.with_attr("tir_var_upper_bound", upper).with_attr("global_symbol", "main")
    return tvm.IRModule({"kernel": func.with_attr("global_symbol", "kernel"), "main": main})


def test_the_pass_narrows_by_the_declared_upper_bounds():
    func = _softmax_of_scores()
    narrowed = NarrowIndices()(_module(func, {"b": 4, "s": 1024}))["kernel"]
    kept = NarrowIndices()(_module(func, {"b": 4}))["kernel"]
    assert _index_dtypes(narrowed) == {"int32"}, narrowed.script()
    assert _index_dtypes(kept) == {"int64"}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_narrowed_kernel_equals_numpy_at_several_shapes(dtype):
    func = _softmax_of_scores(dtype)
    mod = NarrowIndices()(_module(func, {"b": 4, "s": 1024}))
    assert _index_dtypes(mod["kernel"]) == {"int32"}
    masked_softmax_equals_numpy(mod["kernel"], dtype, ((1, 1, 1), (2, 7, 7), (3, 33, 33),
                                                       (1, 130, 130)))
