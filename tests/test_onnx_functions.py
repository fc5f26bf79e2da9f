"""ONNX function operators TVM's importer lacks, expanded into their standard bodies
(``grape_tvm.onnx_functions``): the rewrite itself, and expanded models against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import grape_tvm
from grape_tvm.onnx_functions import FUNCTIONS_DOMAIN, functions_expanded

OPSET = 22


def _loss_model(op: str, **attrs) -> onnx.ModelProto:
    """``op(scores [N, C], labels [N])`` with N dynamic, C = 5: a loss, reduced as asked."""
    scores = helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 5])
    labels = helper.make_tensor_value_info("labels", TensorProto.INT64, ["N"])
    loss = helper.make_tensor_value_info(
        "loss", TensorProto.FLOAT, ["N"] if attrs.get("reduction") == "none" else [])
    node = helper.make_node(op, ["scores", "labels"], ["loss"], **attrs)
    graph = helper.make_graph([node], "loss", [scores, labels], [loss])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def _op_types(model: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in model.graph.node}


def test_an_operator_tvm_lacks_becomes_its_standard_body():
    """NegativeLogLikelihoodLoss (a context-dependent function) becomes standard operators:
    no call of it, no model-local function or opset left behind."""
    model = _loss_model("NegativeLogLikelihoodLoss", reduction="mean")
    expanded = functions_expanded(model, OPSET)
    assert "NegativeLogLikelihoodLoss" not in _op_types(expanded)
    assert not expanded.functions
    assert [o.domain for o in expanded.opset_import] == [""]
    assert all(n.domain in ("", "ai.onnx") for n in expanded.graph.node)
    onnx.checker.check_model(expanded)


def test_bodies_that_call_functions_are_expanded_again():
    """SoftmaxCrossEntropyLoss's body calls NegativeLogLikelihoodLoss: both go."""
    expanded = functions_expanded(_loss_model("SoftmaxCrossEntropyLoss"), OPSET)
    assert not {"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"} & _op_types(expanded)


@pytest.mark.parametrize("opset", [13, 18, 22])
def test_expanded_nodes_inside_a_graph_equal_onnxruntime(opset, tmp_path):
    """Two Celu in a row and a Relu after them: values between expanded nodes have no
    declared type, and at opsets before the body's own the inliner converts the body,
    which needs their types."""
    ort = pytest.importorskip("onnxruntime")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    nodes = [helper.make_node("Celu", ["x"], ["a"], alpha=0.5),
             helper.make_node("Celu", ["a"], ["b"]), helper.make_node("Relu", ["b"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", opset)])
    assert "Celu" not in _op_types(functions_expanded(model, opset))
    module = grape_tvm.compile_onnx(model, dims={"N": (1, 8)}, target="llvm")
    executor = grape_tvm.load(module.export(tmp_path / "celu.grape"))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for n in (1, 8):
        feeds = {"x": np.random.default_rng(n).standard_normal((n, 4)).astype(np.float32)}
        np.testing.assert_allclose(executor.run(feeds)["y"], session.run(None, feeds)[0],
                                   rtol=1e-5, atol=1e-6)


def test_operators_tvm_converts_are_left_alone():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    assert functions_expanded(model, OPSET) is model


def test_standard_attention_is_not_read_as_the_contrib_operator():
    """TVM maps ``Attention`` to ONNX Runtime's contrib operator (``num_heads``, packed
    weights); opset 23's standard Attention is expanded instead."""
    shape = [2, 3, 4, 8]  # batch, heads, sequence, head size
    q, k, v = (helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in "qkv")
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    graph = helper.make_graph([helper.make_node("Attention", ["q", "k", "v"], ["y"])], "g",
                              [q, k, v], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    assert "Attention" not in _op_types(functions_expanded(model, 23))
    assert FUNCTIONS_DOMAIN not in {o.domain for o in functions_expanded(model, 23).opset_import}


@pytest.mark.parametrize("op,attrs", [
    ("SoftmaxCrossEntropyLoss", {"reduction": "mean"}),
    ("SoftmaxCrossEntropyLoss", {"reduction": "none", "ignore_index": 2}),
    ("NegativeLogLikelihoodLoss", {"reduction": "sum"}),
])
def test_expanded_losses_equal_onnxruntime_at_every_batch(op, attrs, tmp_path):
    """Compiled with N symbolic in 1..16 and run at N = 1, 7, 16 (labels hitting the ignored
    class too), equal to onnxruntime on the unexpanded model."""
    ort = pytest.importorskip("onnxruntime")
    model = _loss_model(op, **attrs)
    module = grape_tvm.compile_onnx(model, dims={"N": (1, 16)}, target="llvm")
    executor = grape_tvm.load(module.export(tmp_path / "loss.grape"))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for n in (1, 7, 16):
        scores = rng.standard_normal((n, 5)).astype(np.float32)
        if op == "NegativeLogLikelihoodLoss":
            scores = np.log(np.exp(scores) / np.exp(scores).sum(1, keepdims=True)).astype(np.float32)
        labels = rng.integers(0, 5, n).astype(np.int64)
        feeds = {"scores": scores, "labels": labels}
        want = session.run(None, feeds)[0]
        got = executor.run(feeds)["loss"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
