"""NaN, infinities and empty reductions, against onnxruntime (issue 13, item 4).

A reduction over a zero-size dim (a range that allows 0) returns the reduction's identity,
as onnxruntime does; Relu, Clip and the element-wise Max/Min keep a NaN as onnxruntime
keeps it. Each on the CPU through ``compile_onnx`` and the executor, at several sizes; the
TIR pass that makes empty reductions work on a tiny PrimFunc.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import grape_tvm
from grape_tvm.passes import HoistReductionInit

INFO = helper.make_tensor_value_info
NODE = helper.make_node
SIZES = (0, 1, 5, 8)


def _model(nodes, inputs, inits=(), opset=18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "numerics", inputs, [INFO("y", TensorProto.FLOAT, None)],
                              list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _run_both(model, dims, feeds_list, tmp_path):
    """grape's output and onnxruntime's for each feed dict."""
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    module = grape_tvm.compile_onnx(model, dims, "llvm")
    executor = grape_tvm.load(module.export(tmp_path / "model.grape"), "cpu")
    return [(executor.run(feeds)["y"], session.run(None, feeds)[0]) for feeds in feeds_list]


def _assert_same(got, want):
    """Equal values, NaN where onnxruntime has NaN, infinities of the same sign."""
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)


# -- empty reductions --------------------------------------------------------------------

REDUCTIONS = ["ReduceSum", "ReduceProd", "ReduceL2", "ReduceLogSumExp", "ReduceSumSquare"]


@pytest.mark.parametrize("op", REDUCTIONS)
@pytest.mark.parametrize("axes", [[0], None], ids=["axis0", "all"])
def test_reduction_over_a_dim_that_can_be_zero(op, axes, tmp_path):
    """(n, 4) reduced over n (or over everything), n = 0..8: at n = 0 the identity
    (0 for a sum, 1 for a product), not what the output buffer held."""
    inits = [numpy_helper.from_array(np.array(axes, np.int64), "axes")] if axes else []
    node = NODE(op, ["x"] + (["axes"] if axes else []), ["y"], keepdims=0)
    model = _model([node], [INFO("x", TensorProto.FLOAT, ["n", 4])], inits)
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((n, 4)).astype(np.float32)} for n in (*SIZES, 0, 3, 0)]
    for got, want in _run_both(model, {"n": (0, 8)}, feeds, tmp_path):
        _assert_same(got, want)


def test_softmax_and_matmul_over_an_empty_dim(tmp_path):
    """Reductions inside fused kernels: a matmul over k = 0 is zeros (plus the bias)."""
    bias = numpy_helper.from_array(np.arange(4, dtype=np.float32), "bias")
    model = _model([NODE("MatMul", ["a", "b"], ["m"]), NODE("Add", ["m", "bias"], ["y"])],
                   [INFO("a", TensorProto.FLOAT, [3, "k"]), INFO("b", TensorProto.FLOAT, ["k", 4])],
                   [bias])
    rng = np.random.default_rng(1)
    feeds = [{"a": rng.standard_normal((3, k)).astype(np.float32),
              "b": rng.standard_normal((k, 4)).astype(np.float32)} for k in (0, 2, 0, 7)]
    for got, want in _run_both(model, {"k": (0, 8)}, feeds, tmp_path):
        _assert_same(got, want)


def test_hoist_reduction_init_moves_the_init_before_the_reduction_loop():
    from tvm.script import relax as R  # pylint: disable=import-outside-toplevel
    from tvm.script import ir as I  # pylint: disable=import-outside-toplevel

    @I.ir_module
    class Sum:
        @R.function
        def main(x: R.Tensor(("n", 4), "float32")):
            with R.dataflow():
                y = R.sum(x, axis=[0])
                R.output(y)
            return y

    legalized = relax.transform.LegalizeOps()(Sum)
    before = legalized["sum"].script()
    assert "T.init()" in before
    after = HoistReductionInit()(legalized)["sum"].script()
    assert "T.init()" not in after
    # The init block comes first, over the spatial loop only; the update follows.
    assert after.index('T.sblock("x_red_init")') < after.index('T.sblock("x_red_update")')
    once = HoistReductionInit()(legalized)
    tvm.ir.assert_structural_equal(HoistReductionInit()(once)["sum"], once["sum"])

