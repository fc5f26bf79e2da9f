"""A decoder that comes as ONNX sharded Megatron's way, automatically (``passes/megatron.py``,
``compile_onnx(..., tensor_parallel=N)``, ``grape-tvm compile --tensor-parallel N``): the pass
on a tiny module; Hugging Face's tiny GPT-2 compiled for 2 and 4 devices, run on a threaded
``TensorParallelSession`` with numpy stand-ins for disco's collectives (``conftest``),
against onnxruntime; the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
from tvm import relax

import grape_tvm
from conftest import onnxruntime_outputs
from grape_tvm.artifact import Artifact
from grape_tvm.cli import main
from grape_tvm.passes.megatron import (COLUMNS_BY_RANKS_ATTR, MegatronError, ShardMegatron,
                                       columns_by_ranks)
from grape_tvm.tensor_parallel_session import TensorParallelSession
from test_cli_errors import refused

DATA = Path(__file__).resolve().parent / "data"
LAYERS, HEADS, HEAD_DIM, VOCAB = 2, 4, 16, 1000
DECODE_DIMS = {"batch": (1, 2), "past": (1, 32)}
PREFILL_DIMS = {"batch": (1, 2), "seq": (1, 32)}


def _decode_inputs(rng, batch: int, past: int) -> dict[str, np.ndarray]:
    feeds = {"input_ids": rng.integers(0, VOCAB, (batch, 1)).astype(np.int64)}
    for i in range(LAYERS):
        for kv in ("key", "value"):
            feeds[f"past_{i}_{kv}"] = rng.standard_normal(
                (batch, HEADS, past, HEAD_DIM)).astype(np.float32)
    return feeds


def _attention(heads: int = 4, dim: int = 8, world: int = 2) -> tvm.IRModule:
    """A GPT-2 block in miniature: a fused qkv product and its bias, split into q, k, v,
    each into heads; attention; the output projection; an MLP."""
    hidden = heads * dim
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, hidden), "float32"))
    w_qkv = relax.Var("w_qkv", relax.TensorType((hidden, 3 * hidden), "float32"))
    b_qkv = relax.Var("b_qkv", relax.TensorType((3 * hidden,), "float32"))
    w_o = relax.Var("w_o", relax.TensorType((hidden, hidden), "float32"))
    w_fc = relax.Var("w_fc", relax.TensorType((hidden, 4 * hidden), "float32"))
    w_proj = relax.Var("w_proj", relax.TensorType((4 * hidden, hidden), "float32"))
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w_qkv, b_qkv, w_o, w_fc, w_proj]):
        with bb.dataflow():
            qkv = bb.emit(op.add(bb.emit(op.matmul(x, w_qkv)), b_qkv))
            split = bb.emit(op.split(qkv, [hidden, 2 * hidden], axis=1))
            q, k, v = (bb.emit(op.permute_dims(op.reshape(bb.emit(relax.TupleGetItem(split, i)),
                                                          (n, heads, dim)), [1, 0, 2]))
                       for i in range(3))
            scores = bb.emit(op.nn.softmax(op.matmul(q, op.permute_dims(k, [0, 2, 1])), -1))
            merged = bb.emit(op.reshape(op.permute_dims(op.matmul(scores, v), [1, 0, 2]),
                                        (n, hidden)))
            h = bb.emit(op.add(x, bb.emit(op.matmul(merged, w_o))))
            normed = bb.emit(op.nn.layer_norm(h, relax.const(np.ones(hidden, "float32")),
                                              relax.const(np.zeros(hidden, "float32")), [-1]))
            fc = bb.emit(op.tanh(bb.emit(op.matmul(normed, w_fc))))
            out = bb.emit_output(op.add(h, bb.emit(op.matmul(fc, w_proj))))
        bb.emit_func_output(out)
    return bb.get()


def _annotations(mod: tvm.IRModule) -> list[tuple[str, str]]:
    """Each annotated value's op and its placement, in order."""
    found = []
    values = relax.analysis.get_var2val(mod["main"])

    def visit(expr):
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == \
                "relax.dist.annotate_sharding":
            source = values[expr.args[0]]
            found.append((source.op.name, str(expr.attrs.placement).strip('"')))

    relax.analysis.post_order_visit(mod["main"], visit)
    return found


def test_the_pass_shards_attention_by_heads_and_the_mlp_by_columns():
    """Before: one device's module. After: the qkv product and its bias split on their
    columns, the fused split reading each rank's columns by (rank, part, dims), the
    output projection replicated; the MLP's first product split, its second replicated;
    the fused weight and bias named for reordering."""
    mod = ShardMegatron(2)(_attention())
    assert _annotations(mod) == [("relax.matmul", "S[1]"), ("relax.add", "S[1]"),
                                 ("relax.matmul", "R"), ("relax.matmul", "S[1]"),
                                 ("relax.matmul", "R")]
    main = mod["main"]
    assert {str(k): int(v) for k, v in main.attrs[COLUMNS_BY_RANKS_ATTR].items()} == \
        {"w_qkv": 3, "b_qkv": 3}
    assert int(mod.attrs["device_num"]) == 2
    text = main.script()
    assert "R.split" not in text
    assert 'R.Tensor((n, 2, 3, 16), dtype="float32") = R.reshape(' in text  # (rank, part, dims)


def test_columns_by_ranks_puts_each_ranks_heads_of_every_part_together():
    # 3 parts (q, k, v) of 4 columns, 2 ranks: rank 0 takes q0 q1 k0 k1 v0 v1
    columns = np.arange(12)
    np.testing.assert_array_equal(columns_by_ranks(columns, 3, 2),
                                  [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11])


@pytest.mark.parametrize("build, message", [
    (lambda: ShardMegatron(3)(_attention()), "has 4 heads, which do not split over 3 devices"),
    (lambda: ShardMegatron(1), "takes 2 or more devices"),
])
def test_the_pass_refuses_what_it_cannot_split(build, message):
    with pytest.raises(MegatronError, match=message):
        build()


def test_the_pass_refuses_a_module_without_a_block():
    x = relax.Var("x", relax.TensorType((2, 8), "float32"))
    w = relax.Var("w", relax.TensorType((8, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.layer_norm(
                relax.op.matmul(x, w), relax.const(np.ones(8, "float32")),
                relax.const(np.zeros(8, "float32")), axes=[-1]))
        bb.emit_func_output(out)
    with pytest.raises(MegatronError, match="no block to shard over 2 devices"):
        ShardMegatron(2)(bb.get())


def test_the_pass_refuses_an_op_it_does_not_understand_inside_a_block():
    """A layer norm between two weight matmuls, on one path of two: not a block it knows."""
    x = relax.Var("x", relax.TensorType((tvm.tirx.Var("n", "int64"), 8), "float32"))
    w1 = relax.Var("w1", relax.TensorType((8, 8), "float32"))
    w2 = relax.Var("w2", relax.TensorType((8, 8), "float32"))
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w1, w2]):
        with bb.dataflow():
            h = bb.emit(op.matmul(x, w1))
            normed = bb.emit(op.nn.layer_norm(h, relax.const(np.ones(8, "float32")),
                                              relax.const(np.zeros(8, "float32")), axes=[-1]))
            out = bb.emit_output(op.add(normed, bb.emit(op.matmul(bb.emit(op.tanh(h)), w2))))
        bb.emit_func_output(out)
    with pytest.raises(MegatronError, match="also relax.nn.layer_norm"):
        ShardMegatron(2)(bb.get())


@pytest.fixture(scope="module")
def decode_artifacts(tmp_path_factory) -> dict[int, Path]:
    folder = tmp_path_factory.mktemp("megatron")
    return {world: grape_tvm.compile_onnx(DATA / "gpt2_decode_tiny.onnx", DECODE_DIMS,
                                          tensor_parallel=world).export(
                                              folder / f"decode{world}.grape")
            for world in (2, 4)}


def _equal_onnxruntime(got: dict, path: Path, feeds: dict) -> None:
    want = onnxruntime_outputs(path, feeds)
    assert list(got) == [o.name for o in onnx.load(str(path)).graph.output]
    for (name, value), ref in zip(got.items(), want):
        np.testing.assert_allclose(value, ref, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("world", [2, 4])
def test_gpt2_decode_on_ranks_equals_onnxruntime(decode_artifacts, disco_collectives, world):
    """The artifact alone (it carries the weights): loaded on a threaded session of
    ``world`` workers, every output (the logits, the caches gathered whole) equals
    onnxruntime's at several batch sizes and cache lengths."""
    disco_collectives(world)
    path = decode_artifacts[world]
    parallel = Artifact.load(path).manifest["plan"]["tensor_parallel"]
    assert parallel["world_size"] == world
    assert parallel["output_shard_plan"] == {f"present_{i}_{kv}": 1 for i in range(LAYERS)
                                             for kv in ("key", "value")}
    assert {f"past_{i}_key": 1 for i in range(LAYERS)}.items() <= parallel["shard_plan"].items()
    rng = np.random.default_rng(world)
    with TensorParallelSession(path, threaded=True, ccl=None) as ranks:
        for batch, past in [(1, 1), (2, 9), (1, 32), (2, 31)]:
            feeds = _decode_inputs(rng, batch, past)
            _equal_onnxruntime(ranks.run(feeds), DATA / "gpt2_decode_tiny.onnx", feeds)


def test_gpt2_prefill_on_ranks_equals_onnxruntime(disco_collectives, tmp_path):
    disco_collectives(2)
    source = DATA / "gpt2_prefill_tiny.onnx"
    path = grape_tvm.compile_onnx(source, PREFILL_DIMS, tensor_parallel=2).export(
        tmp_path / "prefill.grape")
    rng = np.random.default_rng(5)
    with TensorParallelSession(path, threaded=True, ccl=None) as ranks:
        for batch, seq in [(1, 1), (2, 7), (1, 32)]:
            feeds = {"input_ids": rng.integers(0, VOCAB, (batch, seq)).astype(np.int64)}
            _equal_onnxruntime(ranks.run(feeds), source, feeds)


def test_cli_compiles_runs_and_inspects_a_sharded_decoder(tmp_path, disco_collectives, capsys):
    """grape-tvm compile --tensor-parallel 2, then run: refused where disco has no
    collectives on the CPU (TVM's case: a worker not finding them aborted the process), then
    run with the stand-in collectives on a threaded session, then inspect; inspect --record
    refused (it records one device's executor)."""
    source = DATA / "gpt2_decode_tiny.onnx"
    artifact = tmp_path / "m.grape"
    assert main(["compile", str(source), "-o", str(artifact), "--tensor-parallel", "2",
                 "--dim", "batch=1:2", "--dim", "past=1:32"]) == 0
    feeds = _decode_inputs(np.random.default_rng(9), 2, 5)
    np.savez(tmp_path / "in.npz", **feeds)
    capsys.readouterr()
    assert main(["run", str(artifact), "--inputs", str(tmp_path / "in.npz"),
                 "--outputs", str(tmp_path / "out.npz")]) == 2
    assert "ranks run on the CPU, through disco's collectives, and this TVM has none for " \
           "the CPU" in capsys.readouterr().err
    assert not (tmp_path / "out.npz").exists()
    assert main(["inspect", str(artifact), "--record"]) == 2
    assert "inspect --record takes an artifact of one device" in capsys.readouterr().err
    disco_collectives(2)
    assert main(["run", str(artifact), "--inputs", str(tmp_path / "in.npz"),
                 "--outputs", str(tmp_path / "out.npz")]) == 0
    with np.load(tmp_path / "out.npz") as out:
        _equal_onnxruntime({k: out[k] for k in out.files}, source, feeds)
    capsys.readouterr()
    assert main(["inspect", str(artifact), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)["tensor_parallel"]
    assert described["world_size"] == 2 and described["shard_plan"]["past_0_key"] == 1
    assert main(["inspect", str(artifact)]) == 0
    assert "tensor parallel: 2 devices" in capsys.readouterr().out


@pytest.mark.parametrize("ranks, message", [
    ("0", "--tensor-parallel takes a number of devices, 1 or more, got 0"),
    ("3", "has 4 heads, which do not split over 3 devices"),
])
def test_cli_refuses_a_bad_number_of_devices(tmp_path, capsys, ranks, message):
    line = refused(capsys, tmp_path, "compile", DATA / "gpt2_decode_tiny.onnx", "-o",
                   tmp_path / "m.grape", "--tensor-parallel", ranks, "--dim", "batch=1:2",
                   "--dim", "past=1:32")
    assert message in line


def test_input_for_varless_calls_reads_an_input_and_computes_the_same():
    """``InputForVarlessCalls`` on a tiny module: two ``arange`` calls that read no tensor
    each become a ``call_tir`` of a function of their own reading ``main``'s first input
    (unread); the module stays well formed, and compiled it computes what it did."""
    from tvm import tirx  # pylint: disable=import-outside-toplevel

    from grape_tvm.passes.megatron import InputForVarlessCalls  # pylint: disable=import-outside-toplevel

    past = tirx.Var("past", "int64")
    x = relax.Var("x", relax.TensorType((past, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.arange(tirx.const(0, "int64"), past, dtype="int64"))
            b = bb.emit(relax.op.arange(tirx.const(0, "int64"), past + 1, dtype="int64"))
            out = bb.emit_output(relax.Tuple([a, b]))
        bb.emit_func_output(out)
    before = bb.get()
    after = InputForVarlessCalls()(before)
    relax.analysis.well_formed(after)  # raises where it is not
    calls = []
    relax.analysis.post_order_visit(after["main"], lambda e: isinstance(e, relax.Call) and calls.append(e))
    tir_calls = [c for c in calls if getattr(c.op, "name", "") == "relax.call_tir"]
    assert len(tir_calls) == 2 and all(c.args[1].fields[0].same_as(after["main"].params[0])
                                       for c in tir_calls)
    data = tvm.runtime.tensor(np.zeros((5, 4), "float32"))
    for mod in (before, after):
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        got = vm["main"](data)
        np.testing.assert_array_equal(got[0].numpy(), np.arange(5))
        np.testing.assert_array_equal(got[1].numpy(), np.arange(6))
