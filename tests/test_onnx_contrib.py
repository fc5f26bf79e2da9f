"""ONNX Runtime's normalization operators (``grape_tvm/onnx_contrib.py``), as its
transformer optimizer fuses them, against onnxruntime: every input combination, every
output, at several sequence lengths."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import grape_tvm
from conftest import onnxruntime_outputs

HIDDEN = 16
info = helper.make_tensor_value_info


def _model(op: str, inputs: list[str], outputs: list[str], domain: str, elem=TensorProto.FLOAT,
           **attrs) -> onnx.ModelProto:
    node = helper.make_node(op, inputs, outputs, domain=domain, **attrs)
    graph_inputs = [info(n, elem, ["batch", "seq", HIDDEN] if n in ("x", "skip")
                         else [HIDDEN]) for n in inputs if n]
    graph = helper.make_graph([node], "m", graph_inputs,
                              [info(n, elem if n in ("y", "sum") else TensorProto.FLOAT, None)
                               for n in outputs if n])  # the statistics are float32
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model


def _equal_onnxruntime(model: onnx.ModelProto, tmp_path, dtype=np.float32, tol=1e-5) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    module = grape_tvm.compile_onnx(path, dims={"batch": (1, 4), "seq": (1, 16)})
    executor = grape_tvm.load(module.export(tmp_path / "m.grape"))
    rng = np.random.default_rng(0)
    names = [v.name for v in model.graph.input]
    for batch, seq in ((1, 1), (2, 7), (4, 16)):
        feeds = {n: rng.standard_normal((batch, seq, HIDDEN) if n in ("x", "skip") else HIDDEN)
                 .astype(dtype) for n in names}
        got = list(executor.run(feeds).values())
        want = onnxruntime_outputs(path, feeds)
        assert len(got) == len(want)
        for value, ref in zip(got, want):
            assert value.shape == ref.shape and value.dtype == ref.dtype, \
                (batch, seq, value.shape, value.dtype, ref.shape, ref.dtype)
            np.testing.assert_allclose(value.astype(np.float32), ref.astype(np.float32),
                                       rtol=tol, atol=tol)


@pytest.mark.parametrize("beta, bias", [(True, True), (True, False), (False, True),
                                        (False, False)])
@pytest.mark.parametrize("outputs", [["y"], ["y", "mean", "inv_std", "sum"], ["y", "", "", "sum"],
                                     ["y", "mean"]])
def test_skip_layer_normalization(beta, bias, outputs, tmp_path):
    """TVM needed both beta and bias, gave 0-d zeros for mean and inv_std_var and no sum."""
    inputs = ["x", "skip", "gamma", "beta" if beta else "", "bias" if bias else ""]
    while not inputs[-1]:
        inputs.pop()
    _equal_onnxruntime(_model("SkipLayerNormalization", inputs, outputs, "com.microsoft",
                              epsilon=1e-5), tmp_path)


def test_skip_layer_normalization_float16_and_its_default_epsilon(tmp_path):
    """Sums and statistics in float32, rounded once, as onnxruntime; epsilon 1e-12."""
    model = _model("SkipLayerNormalization", ["x", "skip", "gamma", "beta", "bias"],
                   ["y", "mean", "inv_std", "sum"], "com.microsoft", elem=TensorProto.FLOAT16)
    _equal_onnxruntime(model, tmp_path, dtype=np.float16, tol=2e-3)


@pytest.mark.parametrize("bias", [True, False])
def test_skip_simplified_layer_normalization(bias, tmp_path):
    """Llama's residual add and RMS norm fused by onnxruntime's optimizer; TVM lacked it.
    Its ``mean`` is zeros, as onnxruntime writes it (an RMS norm has no centering)."""
    inputs = ["x", "skip", "gamma"] + (["bias"] if bias else [])
    _equal_onnxruntime(_model("SkipSimplifiedLayerNormalization", inputs,
                              ["y", "mean", "inv_std", "sum"], "com.microsoft", epsilon=1e-6),
                       tmp_path)


@pytest.mark.parametrize("elem, dtype, tol", [(TensorProto.FLOAT, np.float32, 1e-5),
                                              (TensorProto.FLOAT16, np.float16, 2e-3)])
@pytest.mark.parametrize("outputs", [["y"], ["y", "inv_std"]])
def test_simplified_layer_normalization(elem, dtype, tol, outputs, tmp_path):
    """An RMS norm, in onnxruntime's default domain; TVM lacked it. Default epsilon."""
    _equal_onnxruntime(_model("SimplifiedLayerNormalization", ["x", "gamma"], outputs, "",
                              elem=elem, axis=-1), tmp_path, dtype=dtype, tol=tol)
