"""FuseAttention on tiny modules: which attention becomes one call of grape's fused kernel,
with which layout, and what is left alone. The kernel itself is tested on the GPU
(tests/test_gpu.py, ``test_fused_attention_equals_numpy``)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

import grape_tvm
from grape_tvm.passes import FuseAttention
from grape_tvm.runtime.attention import SOURCE, AttentionLayout
from grape_tvm.runtime.cuda_compile import nvcc_available, source_key

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from models import attention_products, causal_attention, causal_attention_numpy  # noqa: E402

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


def _fused(mod: tvm.IRModule) -> list[relax.Call]:
    """The ``grape.attention`` calls of ``main`` after FuseAttention."""
    out = FuseAttention()(relax.transform.ConvertToDataflow()(mod))
    calls = []

    def visit(expr):
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.call_dps_packed" \
                and expr.args[0].global_symbol.startswith("grape.attention."):
            calls.append(expr)

    relax.analysis.post_order_visit(out["main"], visit)
    ops = set()
    relax.analysis.post_order_visit(out["main"], lambda e: isinstance(e, relax.Call) and
                                    hasattr(e.op, "name") and ops.add(e.op.name))
    assert ("relax.nn.softmax" in ops) != bool(calls)  # fused, or left whole
    return calls


def _layout(call: relax.Call, b: int = 2, s: int = 10) -> AttentionLayout:
    """The call's layout at batch b and s rows (its output is [b, s, heads, head_dim])."""
    analyzer = tvm.sym.Analyzer()
    for var, value in zip(call.ty.shape.values[:2], (b, s)):
        analyzer.bind(var, tirx.const(value, "int64"))
    shape = call.args[1].fields[-2]
    return AttentionLayout.from_shape([int(analyzer.simplify(v)) for v in shape.values])


def test_causal_mask_of_aranges_is_the_kernels_causal_mode():
    """GPT-2's export: q, k and v sliced out of one qkv tensor and read in place; the mask,
    where(key <= query, 0, -65504), no bias read; the output written [b, s, h, d]."""
    (call,) = _fused(causal_attention("float16"))
    assert call.args[0].global_symbol == "grape.attention.fused_causal"
    args = call.args[1].fields
    assert len(args) == 5  # q, k, v (one tensor), layout, scale
    assert args[0].same_as(args[1]) and args[1].same_as(args[2])
    assert float(args[-1].value) == pytest.approx(0.125)
    layout = _layout(call)
    assert (layout.batch, layout.heads, layout.rows, layout.keys, layout.head_dim) == (2, 12, 10, 10, 64)
    row = 3 * 12 * 64
    for view, offset in ((layout.q, 0), (layout.k, 768), (layout.v, 1536)):
        assert (view.offset, view.batch, view.head, view.row) == (offset, 10 * row, 64, row)
    assert (layout.out.offset, layout.out.batch, layout.out.head, layout.out.row) == (0, 10 * 768, 64, 768)
    assert [int(d) if isinstance(d, tirx.IntImm) else str(d) for d in call.ty.shape.values] == \
        ["b", "s", 12, 64]


def test_bias_input_is_read_broadcast_over_heads():
    (call,) = _fused(causal_attention("float16", mask="bias"))
    assert call.args[0].global_symbol == "grape.attention.fused_bias"
    bias = _layout(call).bias
    assert (bias.offset, bias.batch, bias.head, bias.row) == (0, 100, 0, 10)


def test_a_mask_that_does_not_remove_its_keys_stays_a_bias():
    """-1 above the diagonal leaves those keys a weight: not the causal mode."""
    (call,) = _fused(causal_attention("float16", masked=-1.0))
    assert call.args[0].global_symbol == "grape.attention.fused_bias"


@pytest.mark.parametrize("model", [
    pytest.param(lambda: causal_attention("float32"), id="float32"),
    pytest.param(lambda: causal_attention("float16", heads=4, head_dim=32), id="head_dim_32"),
    pytest.param(lambda: attention_products("float16"), id="decode_one_row"),
])
def test_left_alone(model):
    assert _fused(model()) == []


def test_scores_read_twice_are_not_fused():
    """A score tensor something else reads must still be computed."""
    b, s = tirx.Var("b", "int64"), tirx.Var("s", "int64")
    q = relax.Var("q", relax.TensorType((b, 12, s, 64), "float16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [q]):
        with bb.dataflow():
            scores = bb.emit(relax.op.matmul(q, relax.op.permute_dims(q, [0, 1, 3, 2])))
            probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
            out = bb.emit_output(relax.Tuple([relax.op.matmul(probs, q), scores]))
        bb.emit_func_output(out)
    assert _fused(bb.get()) == []


def test_cpu_build_is_unfused_and_equals_numpy(tmp_path):
    """On llvm nothing is fused; the model and its numpy reference agree (the GPU test
    relies on both)."""
    module = grape_tvm.build(causal_attention("float32"), {"b": (1, 2), "s": (1, 64)}, "llvm",
                             output_names=["y"])
    assert module.manifest()["plan"].get("libraries", []) == []
    executor = grape_tvm.load(module.export(tmp_path / "attention.grape"))
    rng = np.random.default_rng(0)
    for b, s in ((1, 1), (2, 7), (1, 64)):
        qkv = rng.standard_normal((b, s, 3 * 12 * 64)).astype("float32")
        got = executor.run({"qkv": qkv})["y"]
        np.testing.assert_allclose(got, causal_attention_numpy(qkv, 12), rtol=1e-4, atol=1e-5)
    executor.close()


@pytest.mark.skipif(not nvcc_available(), reason="nvcc")
def test_cuda_build_calls_the_library_and_carries_its_cubin():
    module = grape_tvm.build(causal_attention("float16"), {"b": (1, 2), "s": (1, 1024)}, CUDA,
                             output_names=["y"])
    plan = module.manifest()["plan"]
    assert plan["libraries"] == ["attention"]
    assert any("grape.attention.fused_causal" in r["kernels"] for r in plan["regions"])
    assert source_key(SOURCE.read_text()) in module.cubins
