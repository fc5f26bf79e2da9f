"""grape's GPU rule for row reductions over the rows of a sequence
(``passes/row_reduction.py``), on tiny modules: the schedule it makes, and what it leaves to
dlight's ``GeneralReduction``. On the GPU its kernels run in GPT-2's prefill and Wav2Vec2
(``bench/hf_models.py``, outputs against PyTorch's); no model of tests/test_gpu.py has rows
of a sequence."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.s_tir import dlight as dl
from tvm_ffi.structural import structural_walk

from grape_tvm.passes import FuseIntoRowReductions
from grape_tvm.passes.row_reduction import WARP, RowReductionPerWarp
from test_passes import CUDA, fused_kernel_of


def _thread_extents(func: tirx.PrimFunc) -> dict:
    """Each thread tag's loop extents (several loops may bind one tag)."""
    found: dict = {}

    def visit(loop):
        if loop.thread_binding is not None:
            found.setdefault(loop.thread_binding.thread_tag, []).append(loop.extent)
    structural_walk(func.body, ((tirx.For, visit),))
    return found


def test_softmax_and_layer_norm_over_symbolic_rows_get_a_warp_per_row():
    b, s = tirx.Var("b", "int64"), tirx.Var("s", "int64")
    softmax = fused_kernel_of(lambda x: relax.op.nn.softmax(x, -1),
                              relax.TensorType((b, 12, s, s), "float16"))
    norm = fused_kernel_of(lambda x, w, c: relax.op.nn.layer_norm(x, w, c, [-1]),
                           relax.TensorType((b, s, 768), "float32"),
                           relax.TensorType((768,), "float32"), relax.TensorType((768,), "float32"))
    for func, batch in ((softmax, "b * T.int64(12)"), (norm, "b")):
        sch = RowReductionPerWarp().apply(func, CUDA, False)
        assert sch is not None
        threads = _thread_extents(sch.mod["main"])
        # every loop over a row (the max, the sum, the quotient) is one warp's lanes
        assert len(threads["threadIdx.x"]) == 3
        assert all(int(extent) == WARP for extent in threads["threadIdx.x"])
        # a block per row: the sequence's rows on x, the batch (and heads) on y
        (rows,), (batches,) = threads["blockIdx.x"], threads["blockIdx.y"]
        assert (str(rows), str(batches)) == ("s", batch)  # the kernel's own dims b and s


def test_rows_of_a_batch_alone_are_left_to_general_reduction():
    """A decode step's: b rows of layer norm, b x 12 rows of softmax over the past."""
    b, past = tirx.Var("b", "int64"), tirx.Var("past", "int64")
    decode_softmax = fused_kernel_of(lambda x: relax.op.nn.softmax(x, -1),
                                     relax.TensorType((b, 12, 1, past), "float32"))
    decode_norm = fused_kernel_of(lambda x, w, c: relax.op.nn.layer_norm(x, w, c, [-1]),
                                  relax.TensorType((b, 1, 768), "float32"),
                                  relax.TensorType((768,), "float32"),
                                  relax.TensorType((768,), "float32"))
    static_rows = fused_kernel_of(lambda x: relax.op.nn.softmax(x, -1),
                                  relax.TensorType((1, 12, 1, 64), "float32"))
    for func in (decode_softmax, decode_norm, static_rows):
        assert RowReductionPerWarp().apply(func, CUDA, False) is None


def test_a_reduction_over_another_axis_than_the_rows_is_left_alone():
    """softmax over axis 1 of (b, s, s): its reductions are not one element of a row."""
    b, s = tirx.Var("b", "int64"), tirx.Var("s", "int64")
    other_axis = fused_kernel_of(lambda x: relax.op.nn.softmax(x, 1),
                                 relax.TensorType((b, s, s), "float32"))
    assert RowReductionPerWarp().apply(other_axis, CUDA, False) is None


def attention_probabilities(dtype: str, batch_rows: bool = False):
    """softmax(s * 0.125 + mask) over (b, 12, s, s) with a (b, 1, s, s) mask, as GPT-2's
    export has it; ``batch_rows``: a decode step's (b, 12, 1, past)."""
    b, s, p = (tirx.Var(name, "int64") for name in ("b", "s", "past"))
    rows, width = (1, p) if batch_rows else (s, s)
    return ((lambda x, mask: relax.op.nn.softmax(
        relax.op.add(relax.op.multiply(x, relax.const(0.125, dtype)), mask), -1)),
        relax.TensorType((b, 12, rows, width), dtype), relax.TensorType((b, 1, rows, width), dtype))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("batch_rows", [False, True])
def test_attention_scale_and_mask_join_the_softmax_kernel(dtype, batch_rows):
    """``FuseIntoRowReductions``: one kernel reads the scores through the scale and the
    mask (``fused_kernel_of`` asserts one PrimFunc), scheduled by the row rule over a
    sequence's rows or by GeneralReduction over a batch's; on llvm, unscheduled, it equals
    numpy at several shapes."""
    make, *types = attention_probabilities(dtype, batch_rows)
    func = fused_kernel_of(make, *types)
    text = func.script()
    assert 'sblock("T_multiply")' in text and 'sblock("T_add")' in text
    sch = RowReductionPerWarp().apply(func, CUDA, False)
    assert (sch is None) == batch_rows
    if batch_rows:
        assert dl.gpu.GeneralReduction().apply(func, CUDA, False) is not None
    else:
        # The mask's index divides by no symbolic dim: with the rows fused into one
        # blockIdx.x it did, in 64 bits, for every element (GPT-2's fp16 prefill: 115 us a
        # call at 1024 tokens).
        source = _cuda_source(sch.mod["main"])
        assert not re.search(r"[/%] \(?s\b", source), source
    shapes = ((1, 1, 1), (2, 7, 7), (1, 33, 33)) if not batch_rows else \
        ((1, 1, 1), (2, 1, 9), (3, 1, 300))
    masked_softmax_equals_numpy(func, dtype, shapes)


def masked_softmax_equals_numpy(func: tirx.PrimFunc, dtype: str, shapes) -> None:
    """``func`` (``attention_probabilities``' kernel) built for llvm equals numpy's
    softmax(x * 0.125 + mask) at each (batch, rows, width) of ``shapes``, a random 30% of
    the mask -65504."""
    kernel = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                         target="llvm")
    rng = np.random.default_rng(0)
    for b, rows, width in shapes:
        x = rng.standard_normal((b, 12, rows, width)).astype(dtype)
        mask = np.where(rng.random((b, 1, rows, width)) < 0.3, -65504.0, 0.0).astype(dtype)
        out = tvm.runtime.empty(x.shape, dtype, tvm.cpu())
        kernel(tvm.runtime.tensor(x), tvm.runtime.tensor(mask), out)
        z = x.astype(np.float64) * 0.125 + mask.astype(np.float64)
        want = np.exp(z - z.max(-1, keepdims=True))
        want /= want.sum(-1, keepdims=True)
        np.testing.assert_allclose(out.numpy().astype(np.float64), want,
                                   atol=1e-6 if dtype == "float32" else 2e-3)


def test_only_row_reductions_take_their_producers():
    """A layer norm is annotated a reduction (its producers join it); a matmul, also
    kOutEWiseFusable to TVM (its consumers join it), stays so."""
    s = tirx.Var("s", "int64")
    x = relax.Var("x", relax.TensorType((1, 32, s), "float32"))
    gamma, beta = (relax.Var(n, relax.TensorType((32,), "float32")) for n in ("gamma", "beta"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, gamma, beta]):
        with bb.dataflow():
            scaled = relax.op.multiply(x, relax.const(2.0))
            y = bb.emit_output(relax.op.matmul(scaled, relax.op.reshape(gamma, [32, 1])))
            z = bb.emit_output(relax.op.nn.layer_norm(scaled, gamma, beta, [1]))
        bb.emit_func_output(relax.Tuple([y, z]))
    assert _patterns(bb.get()) == {"multiply": 0, "reshape": 2, "matmul": 4, "layer_norm": 3}


def _cuda_source(func: tirx.PrimFunc) -> str:
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    return tvm.tirx.build(mod, CUDA).imports[0].inspect_source()


def _patterns(mod: tvm.IRModule) -> dict[str, int]:
    """Each PrimFunc's op_pattern after legalization, annotation and FuseIntoRowReductions."""
    mod = tvm.transform.Sequential([relax.transform.LegalizeOps(),
                                    relax.transform.AnnotateTIROpPattern(),
                                    FuseIntoRowReductions()])(mod)
    return {g.name_hint: int(f.attrs["op_pattern"]) for g, f in mod.functions_items()
            if isinstance(f, tirx.PrimFunc)}
