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

REDUCTIONS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2",
              "ReduceLogSumExp", "ReduceSumSquare"]


@pytest.mark.parametrize("op", REDUCTIONS)
@pytest.mark.parametrize("axes", [[0], None], ids=["axis0", "all"])
def test_reduction_over_a_dim_that_can_be_zero(op, axes, tmp_path):
    """(n, 4) reduced over n (or over everything), n = 0..8: at n = 0 the identity
    (0, 1, -inf, +inf; ReduceMean 0, as onnxruntime), not what the output buffer held."""
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


# -- NaN and infinities ------------------------------------------------------------------

_SPECIAL = np.array([np.nan, 1.5, -np.inf, -2.0, np.inf, 0.0, -0.0, 7.0, np.nan, -0.5],
                    np.float32)


def _values(n: int, shift: int = 0) -> np.ndarray:
    return np.roll(np.resize(_SPECIAL, n), shift).astype(np.float32)


def _const(name: str, value: float):
    return numpy_helper.from_array(np.array(value, np.float32), name)


ACTIVATIONS = {
    "Relu": ([NODE("Relu", ["x"], ["y"])], [], 17),
    "Clip": ([NODE("Clip", ["x", "lo", "hi"], ["y"])], [_const("lo", -1.0), _const("hi", 1.0)], 17),
    "Clip-min-only": ([NODE("Clip", ["x", "lo"], ["y"])], [_const("lo", 0.0)], 17),
    "Clip-attributes": ([NODE("Clip", ["x"], ["y"], min=0.0, max=6.0)], [], 6),
    "HardSigmoid": ([NODE("HardSigmoid", ["x"], ["y"])], [], 17),
    "Elu": ([NODE("Elu", ["x"], ["y"])], [], 17),
    "Selu": ([NODE("Selu", ["x"], ["y"])], [], 17),
    "LeakyRelu": ([NODE("LeakyRelu", ["x"], ["y"], alpha=0.1)], [], 17),
    "Sign": ([NODE("Sign", ["x"], ["y"])], [], 17),
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_keeps_nan_like_onnxruntime(name, tmp_path):
    nodes, inits, opset = ACTIVATIONS[name]
    model = _model(nodes, [INFO("x", TensorProto.FLOAT, ["n"])], inits, opset)
    feeds = [{"x": _values(n, shift)} for n, shift in ((10, 0), (3, 0), (17, 4), (1, 0))]
    for got, want in _run_both(model, {"n": (1, 32)}, feeds, tmp_path):
        _assert_same(got, want)


@pytest.mark.parametrize("op", ["Max", "Min"])
@pytest.mark.parametrize("second", [["n"], [1]], ids=["same", "broadcast"])
def test_elementwise_max_min_keep_nan_like_onnxruntime(op, second, tmp_path):
    model = _model([NODE(op, ["a", "b"], ["y"])],
                   [INFO("a", TensorProto.FLOAT, ["n"]), INFO("b", TensorProto.FLOAT, second)])
    feeds = []
    for n, shift in ((10, 3), (4, 1), (17, 5)):
        b = _values(n, shift) if second == ["n"] else np.array([np.nan], np.float32)
        feeds.append({"a": _values(n), "b": b})
    feeds.append({"a": _values(6), "b": np.array([0.5], np.float32) if second == [1]
                  else np.full(6, 0.5, np.float32)})
    for got, want in _run_both(model, {"n": (1, 32)}, feeds, tmp_path):
        _assert_same(got, want)


def test_nan_kernels_keep_their_names_and_fuse(tmp_path):
    """grape's relu is still ``relu``, fused with the matmul before it."""
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    model = _model([NODE("MatMul", ["x", "w"], ["m"]), NODE("Relu", ["m"], ["y"])],
                   [INFO("x", TensorProto.FLOAT, ["n", 4])], [w])
    module = grape_tvm.compile_onnx(model, {"n": (1, 8)}, "llvm")
    assert [r["kernels"] for r in module.plan["regions"]] == [["fused_matmul_relu"]]
    x = _values(8).reshape(2, 4)
    x[np.isinf(x)] = 3.0  # inf * 0 in the matmul is NaN anyway
    got = grape_tvm.load(module.export(tmp_path / "m.grape"), "cpu").run({"x": x})["y"]
    m = x @ np.eye(4, dtype=np.float32)  # a NaN makes its row NaN (NaN * 0)
    _assert_same(got, np.where(m < 0, np.float32(0), m))


def test_numerics_legalize_map_on_a_tiny_module():
    """relu, clip, maximum and max over a symbolic dim, legalized by grape's map: the kernel
    names are TVM's, NaN stays NaN, and the max over nothing is -inf."""
    from tvm.script import ir as I  # pylint: disable=import-outside-toplevel
    from tvm.script import relax as R  # pylint: disable=import-outside-toplevel

    from grape_tvm.passes import numerics_legalize_map  # pylint: disable=import-outside-toplevel

    @I.ir_module
    class Ops:
        @R.function
        def main(x: R.Tensor(("n",), "float32"), b: R.Tensor((1,), "float32")):
            with R.dataflow():
                r = R.nn.relu(x)
                c = R.clip(r, 0.0, 6.0)
                m = R.maximum(c, b)
                top = R.max(x, axis=[0], keepdims=True)
                y = R.concat([m, top], axis=0)
                R.output(y)
            return y

    mod = relax.transform.LegalizeOps(numerics_legalize_map())(Ops)
    assert {"relu", "tir_clip", "maximum", "max"} <= {gv.name_hint for gv in mod.get_global_vars()}
    assert "T.max" not in mod["relu"].script() and "T.Select" in mod["relu"].script()
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    b = np.array([-1.0], np.float32)
    x = np.array([np.nan, -3.0, 9.0, 2.0], np.float32)
    got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(b)).numpy()
    np.testing.assert_array_equal(got[:4], [np.nan, 0.0, 6.0, 2.0])
    empty = vm["main"](tvm.runtime.tensor(np.zeros(0, np.float32)), tvm.runtime.tensor(b)).numpy()
    np.testing.assert_array_equal(empty, [-np.inf])


def test_numerics_legalizations_schedule_for_cuda():
    """The same kernels through grape's CUDA pipeline: dlight schedules every one (the
    pipeline's kernel check passes), fused as before. Built only: no GPU here."""
    from tvm.script import ir as I  # pylint: disable=import-outside-toplevel
    from tvm.script import relax as R  # pylint: disable=import-outside-toplevel

    from grape_tvm.passes import unbound_kernels  # pylint: disable=import-outside-toplevel
    from grape_tvm.pipeline import grape_pipeline  # pylint: disable=import-outside-toplevel

    @I.ir_module
    class Layer:
        @R.function
        def main(x: R.Tensor(("n", 64), "float32"), w: R.Tensor((64, 64), "float32"),
                 b: R.Tensor((1, 64), "float32")):
            with R.dataflow():
                h = R.maximum(R.clip(R.nn.relu(R.matmul(x, w)), 0.0, 6.0), b)
                top = R.max(h, axis=[0], keepdims=True)
                mean = R.mean(h, axis=[0], keepdims=True)
                y = R.add(top, mean)
                R.output(y)
            return y

    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    lowered = grape_pipeline(cuda, {"n": (0, 64)}, matmul="tvm")(Layer)
    assert unbound_kernels(lowered) == []
    kernels = [k for r in grape_tvm.passes.graph_plan(lowered).regions for k in r.kernels]
    assert "fused_matmul_relu_tir_clip_maximum" in kernels


def _legalized_vm(mod: tvm.IRModule) -> relax.VirtualMachine:
    from grape_tvm.passes import numerics_legalize_map  # pylint: disable=import-outside-toplevel

    mod = relax.transform.LegalizeOps(numerics_legalize_map())(mod)
    return relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())


def test_max_over_a_slice_of_minus_infinity_is_minus_infinity():
    """A fully masked attention row: max of all -inf was TVM's identity, -3.4e38, so a
    ``max == -inf`` mask test failed and the softmax of the row gave NaN."""
    from tvm.script import ir as I  # pylint: disable=import-outside-toplevel
    from tvm.script import relax as R  # pylint: disable=import-outside-toplevel

    @I.ir_module
    class RowMax:
        @R.function
        def main(x: R.Tensor(("n", 4), "float32")):
            with R.dataflow():
                top = R.max(x, axis=[-1], keepdims=True)
                low = R.min(R.negative(x), axis=[-1], keepdims=True)
                y = R.concat([top, low], axis=1)
                R.output(y)
            return y

    vm = _legalized_vm(RowMax)
    for rows in (1, 3):
        x = np.full((rows, 4), -np.inf, np.float32)
        x[0, 1] = 2.0  # one row with a finite value
        got = vm["main"](tvm.runtime.tensor(x)).numpy()
        want = np.concatenate([x.max(axis=1, keepdims=True), (-x).min(axis=1, keepdims=True)], 1)
        np.testing.assert_array_equal(got, want)


def test_half_precision_matmul_and_softmax_sum_in_float32():
    """fp16 matmul and softmax computed in float32 and rounded once, as PyTorch and onnx's
    reference do: TVM summed a 256-term dot in fp16 (a few ulps off), and onnx's fp16
    attention cases missed their 1e-3 tolerance."""
    from tvm.script import ir as I  # pylint: disable=import-outside-toplevel
    from tvm.script import relax as R  # pylint: disable=import-outside-toplevel

    @I.ir_module
    class Scores:
        @R.function
        def main(q: R.Tensor(("n", 256), "float16"), k: R.Tensor((256, 16), "float16")):
            with R.dataflow():
                s = R.matmul(q, k)
                p = R.nn.softmax(s, axis=-1)
                y = R.concat([s, p], axis=1)
                R.output(y)
            return y

    vm = _legalized_vm(Scores)
    rng = np.random.default_rng(3)
    for rows in (1, 4):
        q = rng.standard_normal((rows, 256)).astype(np.float16) / 4
        k = rng.standard_normal((256, 16)).astype(np.float16) / 4
        got = vm["main"](tvm.runtime.tensor(q), tvm.runtime.tensor(k)).numpy()
        wide = q.astype(np.float32) @ k.astype(np.float32)
        np.testing.assert_array_equal(got[:, :16], wide.astype(np.float16))
        scores = wide.astype(np.float16).astype(np.float32)
        soft = np.exp(scores - scores.max(axis=1, keepdims=True))
        soft = (soft / soft.sum(axis=1, keepdims=True)).astype(np.float16)
        np.testing.assert_allclose(got[:, 16:].astype(np.float32), soft.astype(np.float32),
                                   rtol=0, atol=2 ** -11)
