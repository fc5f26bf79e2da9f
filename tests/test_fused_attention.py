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
from tvm_ffi.structural import structural_equal

import grape_tvm
from grape_tvm.passes import FuseAttention
from grape_tvm.runtime.attention import (DECODE_FUNCTION_PREFIX, DECODE_SOURCE, FUNCTION_PREFIX,
                                         SOURCE, AttentionLayout)
from grape_tvm.runtime.cuda_compile import nvcc_available, source_key

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from models import (attention_products, cached_attention, causal_attention,  # noqa: E402
                    causal_attention_numpy, dense_attention)

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


def _fused(mod: tvm.IRModule) -> list[relax.Call]:
    """The attention calls (either library's) of ``main`` after FuseAttention."""
    out = FuseAttention()(relax.transform.ConvertToDataflow()(mod))
    calls = []

    def visit(expr):
        if isinstance(expr, relax.Call) and \
                getattr(expr.op, "name", "") == "relax.call_dps_packed" and \
                expr.args[0].global_symbol.startswith((FUNCTION_PREFIX, DECODE_FUNCTION_PREFIX)):
            calls.append(expr)

    relax.analysis.post_order_visit(out["main"], visit)
    relax.analysis.well_formed(out)  # raises where it is not
    assert structural_equal(out["main"].ret_ty, mod["main"].ret_ty)  # the result unchanged
    ops = set()
    relax.analysis.post_order_visit(out["main"], lambda e: isinstance(e, relax.Call) and
                                    hasattr(e.op, "name") and ops.add(e.op.name))
    assert ("relax.nn.softmax" in ops) != bool(calls)  # fused, or left whole
    return calls


def _layout(call: relax.Call, b: int = 2, s: int = 10) -> AttentionLayout:
    """The call's layout at dims b and s (those of its output's and operands' shapes)."""
    analyzer = tvm.sym.Analyzer()
    tensors = [call] + [a for a in call.args[1].fields if isinstance(a.ty, relax.TensorType)]
    for var in {v for t in tensors for v in t.ty.shape.values if isinstance(v, tirx.Var)}:
        analyzer.bind(var, tirx.const({"b": b, "s": s}[var.name], "int64"))
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
    sizes = (layout.batch, layout.heads, layout.rows, layout.keys, layout.head_dim)
    assert sizes == (2, 12, 10, 10, 64)
    row = 3 * 12 * 64
    for view, offset in ((layout.q, 0), (layout.k, 768), (layout.v, 1536)):
        assert (view.offset, view.batch, view.head, view.row) == (offset, 10 * row, 64, row)
    out = layout.out
    assert (out.offset, out.batch, out.head, out.row) == (0, 10 * 768, 64, 768)
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


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_decode_one_row_runs_the_decode_kernel(dtype):
    """A query of one row over a symbolic past (GPT-2's decode step), fp32 too: the decode
    kernel, k and v read dense, the mask read broadcast over heads, the output left
    [b, h, 1, d]."""
    (call,) = _fused(attention_products(dtype, mask=True))
    assert call.args[0].global_symbol == "grape.decode_attention.fused_bias"
    assert float(call.args[1].fields[-1].value) == pytest.approx(0.125)
    analyzer = tvm.sym.Analyzer()
    for var in call.args[1].fields[1].ty.shape.values:  # k: (b, 12, p, 64)
        if not isinstance(var, tirx.IntImm):
            analyzer.bind(var, tirx.const({"b": 2, "p": 10}[var.name], "int64"))
    layout = AttentionLayout.from_shape([int(analyzer.simplify(v))
                                         for v in call.args[1].fields[-2].values])
    assert (layout.batch, layout.heads, layout.rows, layout.keys, layout.head_dim) == \
        (2, 12, 1, 10, 64)
    assert (layout.k.batch, layout.k.head, layout.k.row) == (12 * 10 * 64, 10 * 64, 64)
    assert (layout.bias.batch, layout.bias.head, layout.bias.row) == (10, 0, 10)
    assert (layout.out.batch, layout.out.head, layout.out.row) == (12 * 64, 64, 64)


def _ops(mod: tvm.IRModule) -> set[str]:
    ops = set()
    relax.analysis.post_order_visit(mod["main"], lambda e: isinstance(e, relax.Call) and
                                    hasattr(e.op, "name") and ops.add(e.op.name))
    return ops


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_decode_steps_cache_append_is_written_by_the_attention(dtype):
    """GPT-2's present = concat(past, new) for k and v, read by the attention and returned:
    one call of the _append function reads the pasts and the new rows in place (heads of
    the qkv, as q) and writes the output and both presents; no concat is left."""
    mod = cached_attention(dtype)
    (call,) = _fused(mod)
    assert call.args[0].global_symbol == "grape.decode_attention.fused_bias_append"
    args = call.args[1].fields
    assert [a.name for a in args[:6]] == ["lv", "past_k", "past_v", "lv", "lv", "mask"]
    assert structural_equal(call.ty, mod["main"].ret_ty)  # (o, present_k, present_v)
    assert "relax.concat" not in _ops(FuseAttention()(relax.transform.ConvertToDataflow()(mod)))
    analyzer = tvm.sym.Analyzer()
    for var in args[1].ty.shape.values[:3]:  # past_k: (b, 12, p, 64)
        if not isinstance(var, tirx.IntImm):
            analyzer.bind(var, tirx.const({"b": 2, "p": 10}[var.name], "int64"))
    layout = AttentionLayout.from_shape([int(analyzer.simplify(v)) for v in args[-2].values])
    assert (layout.keys, layout.past) == (11, 10)
    row = 3 * 12 * 64
    for view, want in ((layout.q, (0, row, 64, row)), (layout.k, (0, 12 * 640, 640, 64)),
                       (layout.k_new, (768, row, 64, row)), (layout.v_new, (1536, row, 64, row)),
                       (layout.k_present, (0, 12 * 704, 704, 64)),
                       (layout.v_present, (0, 12 * 704, 704, 64))):
        assert (view.offset, view.batch, view.head, view.row) == want


def _cached_step_also_summing(op_name: str, axes=None) -> tvm.IRModule:
    """``cached_attention``'s step with the output of its first ``op_name`` binding (of
    these ``axes``) also summed right after it, the sum returned too."""
    func = cached_attention("float32")["main"]
    (block,) = func.body.blocks

    def read_again(binding) -> bool:
        value = binding.value
        return isinstance(value, relax.Call) and value.op.name == op_name and \
            (axes is None or [int(a) for a in value.attrs.axes] == axes)

    bb = relax.BlockBuilder()
    total = None
    with bb.function("main", list(func.params)):
        with bb.dataflow():
            for binding in block.bindings[:-1]:
                bb.emit_normalized(binding)
                if total is None and read_again(binding):
                    total = bb.emit(relax.op.sum(binding.var))
            outputs = list(block.bindings[-1].value.fields) + [total]
            out = bb.emit_output(relax.Tuple(outputs))
        bb.emit_func_output(out)
    return bb.get()


def _appending_in_a_branch() -> tvm.IRModule:
    """``cached_attention``'s step as the then-branch of an ``if`` left in the function (as
    ``OutlineBranches`` leaves a branch with an impure call); the else-branch appends
    zeros."""
    func = cached_attention("float32")["main"]
    past_k, past_v = func.params[1], func.params[2]
    b = past_k.ty.shape.values[0]
    cond = relax.Var("cond", relax.TensorType((), "bool"))
    (block,) = func.body.blocks
    then = relax.SeqExpr([relax.DataflowBlock(list(block.bindings))], func.body.body)
    bb = relax.BlockBuilder()
    with bb.function("main", list(func.params) + [cond]):
        zero_row = relax.op.zeros((b, 12, 1, 64), "float32")
        otherwise = relax.Tuple([zero_row, relax.op.concat([past_k, zero_row], axis=-2),
                                 relax.op.concat([past_v, zero_row], axis=-2)])
        bb.emit_func_output(bb.emit(relax.If(cond, then, bb.normalize(otherwise))))
    return bb.get()


def test_an_attention_inside_a_branch_fuses_without_appending():
    """The branch's bindings are not the function's: the attention fuses, reading the
    concats' outputs (the pass once failed there looking its binding up)."""
    (call,) = _fused(_appending_in_a_branch())
    assert call.args[0].global_symbol == "grape.decode_attention.fused_bias"


def test_k_transposed_read_again_keeps_the_concat_and_appends_nothing():
    """permute_dims(present_k) read by something besides the scores: present_k must be
    computed anyway, so the attention does not write it again."""
    (call,) = _fused(_cached_step_also_summing("relax.permute_dims", [0, 1, 3, 2]))
    assert call.args[0].global_symbol == "grape.decode_attention.fused_bias"


def test_the_append_can_be_left_to_the_concats(monkeypatch):
    """``APPEND_TO_CACHES`` off (the benchmarks' A/B): the attention alone, the concats kept."""
    from grape_tvm.passes import fused_attention  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(fused_attention, "APPEND_TO_CACHES", False)
    mod = cached_attention("float32")
    (call,) = _fused(mod)
    assert call.args[0].global_symbol == "grape.decode_attention.fused_bias"
    assert "relax.concat" in _ops(FuseAttention()(relax.transform.ConvertToDataflow()(mod)))


def test_a_present_read_before_the_attention_is_left_a_concat():
    """A present read before the attention (by a sum here): the attention fuses without
    appending, reading both concats' outputs dense."""
    mod = _cached_step_also_summing("relax.concat")  # present_k, before the scores
    (call,) = _fused(mod)
    assert call.args[0].global_symbol == "grape.decode_attention.fused_bias"
    assert "relax.concat" in _ops(FuseAttention()(relax.transform.ConvertToDataflow()(mod)))


def _where_masked(fill: float) -> tvm.IRModule:
    """A decode step's attention over a static cache whose unwritten keys are masked by a
    ``where`` (``models.decoder_step``'s): keys j <= pos of 288."""
    b = tirx.Var("b", "int64")
    q = relax.Var("q", relax.TensorType((b, 4, 1, 64), "float32"))
    k = relax.Var("k", relax.TensorType((b, 4, 288, 64), "float32"))
    v = relax.Var("v", relax.TensorType((b, 4, 288, 64), "float32"))
    pos = relax.Var("pos", relax.TensorType((1,), "int32"))
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v, pos]):
        with bb.dataflow():
            visible = bb.emit(op.less_equal(relax.const(np.arange(288, dtype="int32")), pos))
            scores = bb.emit(op.multiply(op.matmul(q, op.permute_dims(k, [0, 1, 3, 2])),
                                         relax.const(0.125, "float32")))
            scores = bb.emit(op.where(visible, scores, relax.const(fill, "float32")))
            out = bb.emit_output(op.matmul(op.nn.softmax(scores, axis=-1), v))
        bb.emit_func_output(out)
    return bb.get()


def test_scores_replaced_where_masked_become_a_bias():
    """``where(visible, s, -1e30)``: the decode kernel with the bias ``where(visible, 0,
    -1e30)``, one row of keys read for every batch and head (s + -1e30 rounds to -1e30)."""
    (call,) = _fused(_where_masked(-1.0e30))
    assert call.args[0].global_symbol == "grape.decode_attention.fused_bias"
    layout = AttentionLayout.from_shape([int(x) if isinstance(x, tirx.IntImm) else 0
                                         for x in call.args[1].fields[-2].values])
    assert (layout.bias.batch, layout.bias.head) == (0, 0)  # one row of keys for all


@pytest.mark.parametrize("model", [
    pytest.param(lambda: causal_attention("float32"), id="float32_many_rows"),
    pytest.param(lambda: causal_attention("float16", heads=4, head_dim=32), id="head_dim_32"),
    pytest.param(lambda: attention_products("float32", head_dim=80), id="decode_head_dim_80"),
    pytest.param(lambda: _where_masked(-1.0e4), id="where_fill_not_overwhelming"),
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
    assert source_key(DECODE_SOURCE.read_text()) not in module.cubins  # not called


@pytest.mark.skipif(not nvcc_available(), reason="nvcc")
def test_cuda_build_of_a_decode_step_carries_only_the_decode_kernels():
    module = grape_tvm.build(attention_products("float32", mask=True),
                             {"b": (1, 2), "p": (1, 1024)}, CUDA, output_names=["o"])
    plan = module.manifest()["plan"]
    assert plan["libraries"] == ["decode_attention"]
    assert any("grape.decode_attention.fused_bias" in r["kernels"] for r in plan["regions"])
    assert source_key(DECODE_SOURCE.read_text()) in module.cubins
    assert source_key(SOURCE.read_text()) not in module.cubins


def _attention_of(q_shape, k_shape, v_shape, prepare=None) -> tvm.IRModule:
    """``softmax(q @ k^T / 8) @ v`` over fp16 inputs of the shapes given (``prepare``: the
    block builder and the params -> (q, k, v) expressions, for views of them)."""
    b, s = tirx.Var("b", "int64"), tirx.Var("s", "int64")

    def dims(shape):
        return [{"b": b, "s": s}.get(d, d) for d in shape]

    params = [relax.Var(n, relax.TensorType(dims(shape), "float16"))
              for n, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape))]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            q, k, v = prepare(bb, *params) if prepare else params
            k_t = relax.op.permute_dims(k, [0, 1, 3, 2])
            scores = bb.emit(relax.op.multiply(relax.op.matmul(q, k_t),
                                               relax.const(0.125, "float16")))
            probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
            out = bb.emit_output(relax.op.nn.relu(relax.op.matmul(probs, v)))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("q,k,v", [
    pytest.param(("b", 12, "s", 64), ("b", 1, "s", 64), ("b", 1, "s", 64), id="shared_heads"),
    pytest.param(("b", 12, "s", 64), (1, 12, "s", 64), (1, 12, "s", 64), id="kv_batch_1"),
    pytest.param((1, 12, "s", 64), ("b", 12, "s", 64), ("b", 12, "s", 64), id="q_batch_1"),
    pytest.param(("b", 12, "s", 64), ("b", 12, "s", 64), ("b", 12, "s", 128), id="v_wider"),
    pytest.param(("b", 12, "s", 128), ("b", 12, "s", 128), ("b", 12, "s", 64), id="v_narrower"),
])
def test_operands_the_kernel_would_misread_are_left_alone(q, k, v):
    """The kernel reads k and v at q's batch and head, with q's head_dim: a matmul that
    broadcasts k or v, or a v of another width, keeps its unfused form (a review found these
    fused into reads past k and v, and the output's shape changed)."""
    assert _fused(_attention_of(q, k, v)) == []


def test_dense_operands_fuse_with_their_own_strides():
    (call,) = _fused(_attention_of(("b", 12, "s", 64), ("b", 12, "s", 64), ("b", 12, "s", 64)))
    layout = _layout(call)
    k = layout.k
    assert (k.offset, k.batch, k.head, k.row) == (0, 12 * 10 * 64, 10 * 64, 64)
    assert (layout.out.batch, layout.out.head, layout.out.row) == (12 * 10 * 64, 10 * 64, 64)


def _heads_of_packed(begins):
    """q, k and v sliced out of one (b, s, 36, 64) tensor, the slices starting at ``begins``."""
    def prepare(bb, q, _k, _v):
        split = bb.emit(relax.op.reshape(q, [q.ty.shape.values[0], q.ty.shape.values[1], 36, 64]))
        return [bb.emit(relax.op.permute_dims(
            relax.op.strided_slice(split, [2], [lo], [lo + 12 if lo + 12 else 36]), [0, 2, 1, 3]))
            for lo in begins]
    return prepare


def test_negative_slice_begins_count_from_the_end():
    """A review found a begin of -36 passed as a negative offset (a read before q)."""
    (call,) = _fused(_attention_of(("b", "s", 2304), ("b", "s", 2304), ("b", "s", 2304),
                                   _heads_of_packed([-36, -24, -12])))
    layout = _layout(call)
    assert [layout.q.offset, layout.k.offset, layout.v.offset] == [0, 768, 1536]


def test_a_concat_of_a_tuple_variable_is_read_dense():
    """A concat whose input is a bound tuple, not a tuple expression: a review found the pass
    crashed on it."""
    def prepare(bb, q, k, v):
        pair = bb.emit(relax.Tuple([k]))
        return q, bb.emit(relax.op.concat(pair, axis=2)), v

    (call,) = _fused(_attention_of(("b", 12, "s", 64), ("b", 12, "s", 64), ("b", 12, "s", 64),
                                   prepare))
    assert _layout(call).k.offset == 0


def test_dense_operands_and_a_two_dim_bias():
    """The GPU test's dense model: q, k and v dense, the output [b, h, s, d], the (s, s) bias
    read with batch and head strides of 0."""
    (call,) = _fused(dense_attention("float16"))
    assert call.args[0].global_symbol == "grape.attention.fused_bias"
    layout = _layout(call)
    assert (layout.q.batch, layout.q.head, layout.q.row) == (12 * 10 * 64, 10 * 64, 64)
    assert (layout.bias.batch, layout.bias.head, layout.bias.row) == (0, 0, 10)
    assert (layout.out.batch, layout.out.head, layout.out.row) == (12 * 10 * 64, 10 * 64, 64)


def _attention(bb, q, k, v):
    scores = bb.emit(relax.op.multiply(relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2])),
                                       relax.const(0.125, "float16")))
    return bb.emit(relax.op.matmul(bb.emit(relax.op.nn.softmax(scores, axis=-1)), v))


def _qkv_function(body, pure: bool = True) -> tvm.IRModule:
    b, s = tirx.Var("b", "int64"), tirx.Var("s", "int64")
    q, k, v = (relax.Var(n, relax.TensorType((b, 12, s, 64), "float16")) for n in "qkv")
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v], pure=pure):
        bb.emit_func_output(body(bb, q, k, v))
    return relax.transform.ConvertToDataflow(min_size=1)(bb.get())


def test_an_attention_over_another_ones_output_reads_it_renamed():
    """The second attention's v is the first's output: a review found the second call read
    the first's variable from before the rewrite (an undefined variable)."""
    def body(bb, q, k, v):
        return _attention(bb, q, k, _attention(bb, q, k, v))

    assert len(_fused(_qkv_function(body))) == 2


def test_no_fusion_reads_an_earlier_blocks_dataflow_variables():
    """An attention's output, a block's output, transposed in the next block (an impure call
    between): fused at the transpose, the call would read the first block's variables."""
    def body(bb, q, k, v):
        out = _attention(bb, bb.emit(relax.op.add(q, q)), k, v)
        bb.emit(relax.op.print(q, format="q"))
        return bb.emit(relax.op.permute_dims(out, [0, 2, 1, 3]))

    assert _fused(_qkv_function(body, pure=False)) == []  # and well formed


def test_no_fusion_reads_an_earlier_blocks_mask():
    """A where mask computed in a dataflow block, the attention's output transposed after it
    in a plain block (an impure call first): the bias made there would read the dataflow
    block's mask, which is gone (a review found the call fused, the IR ill-formed)."""
    b, s = tirx.Var("b", "int64"), tirx.Var("s", "int64")
    q, k, v = (relax.Var(n, relax.TensorType((b, 12, s, 64), "float16")) for n in "qkv")
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v], pure=False):
        with bb.dataflow():
            keys = op.permute_dims(op.sum(k, axis=[1, 3], keepdims=True), [0, 1, 3, 2])
            keep = bb.emit(op.greater(keys, relax.const(0.0, "float16")))  # (b, 1, 1, s)
            scores = bb.emit(op.multiply(op.matmul(q, op.permute_dims(k, [0, 1, 3, 2])),
                                         relax.const(0.125, "float16")))
            scores = bb.emit(op.where(keep, scores, relax.const(-np.inf, "float16")))
            out = bb.emit_output(op.matmul(bb.emit(op.nn.softmax(scores, axis=-1)), v))
        bb.emit(op.print(q, format="q"))
        bb.emit_func_output(bb.emit(op.permute_dims(out, [0, 2, 1, 3])))
    assert _fused(bb.get()) == []  # and well formed


def test_a_mask_shared_by_layers_is_made_once():
    """``decoder_step``'s layers mask their scores with one ``where``: one bias for all."""
    from models import DECODER_SMALL, decoder_step  # pylint: disable=import-outside-toplevel

    out = FuseAttention()(relax.transform.ConvertToDataflow()(decoder_step(**DECODER_SMALL)))
    text = out["main"].script()
    assert text.count("grape.decode_attention.fused_bias") == DECODER_SMALL["layers"]
    biases = [line for line in text.splitlines() if "mask_bias" in line and "= R.where" in line]
    assert len(biases) == 1, biases


@pytest.mark.parametrize("scaled", [
    pytest.param(lambda s: relax.op.multiply(relax.const(0.125, "float16"), s), id="constant_first"),
    pytest.param(lambda s: relax.op.divide(s, relax.const(8.0, "float16")), id="divided"),
])
def test_the_scale_however_written(scaled):
    def body(bb, q, k, v):
        scores = bb.emit(scaled(relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2]))))
        probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
        return bb.emit(relax.op.matmul(probs, v))

    (call,) = _fused(_qkv_function(body))
    assert float(call.args[1].fields[-1].value) == pytest.approx(0.125)


def decoder_q_attention(begin: int, heads: int = 4, head_dim: int = 64) -> tvm.IRModule:
    """A decode step's attention as ``bench/models.py: decoder_step`` writes it, fp32: q is
    columns ``begin..`` of a (b, 3 * width) qkv product reshaped to (b, heads, head_dim) and
    then to (b, heads, 1, head_dim); k and v are dense (b, heads, s, head_dim) caches."""
    b, s = tirx.Var("b", "int64"), tirx.Var("s", "int64")
    width = heads * head_dim
    qkv = relax.Var("qkv", relax.TensorType((b, 3 * width), "float32"))
    k, v = (relax.Var(n, relax.TensorType((b, heads, s, head_dim), "float32")) for n in "kv")
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("main", [qkv, k, v]):
        with bb.dataflow():
            q = bb.emit(op.reshape(op.strided_slice(qkv, axes=[1], begin=[begin],
                                                    end=[begin + width]),
                                   (b, heads, head_dim)))
            scores = bb.emit(op.multiply(
                op.matmul(op.reshape(q, (b, heads, 1, head_dim)), op.permute_dims(k, [0, 1, 3, 2])),
                relax.const(head_dim ** -0.5, "float32")))
            out = bb.emit_output(op.matmul(op.nn.softmax(scores, axis=-1), v))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("begin", [0, 256, 512])
def test_a_decoders_q_is_read_out_of_its_qkv_product(begin):
    """q sliced out of the qkv product's columns and reshaped to heads is read in place (the
    decode-loop benchmark's decoder had a slice kernel for it in every layer)."""
    (call,) = _fused(decoder_q_attention(begin))
    assert call.args[0].global_symbol == "grape.decode_attention.fused"
    assert call.args[1].fields[0].name == "qkv"
    q = _layout(call).q
    assert (q.offset, q.batch, q.head, q.row) == (begin, 768, 64, 64)


def _rows_sliced_q(rows, width: int, end: int, q_shape: tuple) -> tvm.IRModule:
    """Attention whose q is rows 0..end of an x of (``rows``, ``width``) reshaped to
    ``q_shape``; k and v of q's batch and heads, s keys."""
    s = tirx.Var("s", "int64")
    x = relax.Var("x", relax.TensorType((rows, width), "float32"))
    k, v = (relax.Var(n, relax.TensorType((*q_shape[:2], s, 64), "float32")) for n in "kv")
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("main", [x, k, v]):
        with bb.dataflow():
            q = bb.emit(op.reshape(op.strided_slice(x, axes=[0], begin=[0], end=[end]), q_shape))
            scores = bb.emit(op.multiply(op.matmul(q, op.permute_dims(k, [0, 1, 3, 2])),
                                         relax.const(0.125, "float32")))
            out = bb.emit_output(op.matmul(op.nn.softmax(scores, axis=-1), v))
        bb.emit_func_output(out)
    return bb.get()


def test_a_slice_across_rows_is_not_a_view_of_columns():
    """A slice of the rows (axis 0) of a 2-D tensor: q is copied, as before."""
    (call,) = _fused(_rows_sliced_q(tirx.Var("b", "int64"), 256, 1, (1, 4, 1, 64)))
    assert call.args[1].fields[0].name != "x"
    q = _layout(call).q
    assert (q.offset, q.batch, q.head, q.row) == (0, 256, 64, 64)


def test_rows_of_a_square_tensor_are_not_read_as_its_columns():
    """Rows 0..64 of a (128, 128) tensor reshaped to (128, 1, 1, 64) pass every check but
    the slice's axis: read as columns, the kernel would take other elements."""
    (call,) = _fused(_rows_sliced_q(128, 128, 64, (128, 1, 1, 64)))
    assert call.args[1].fields[0].name != "x"
