"""ONNX ``Loop`` through grape's loop (``grape_tvm.onnx_loop``), against onnxruntime.

TVM's importer rejects ``Loop``; grape imports its body as a ``compile_loop`` step. On the
CPU the loop runs one executor call per step (``HostLoop``); on a GPU the same artifact is
one CUDA graph with a WHILE node. Every case compares outputs and the number of steps with
onnxruntime: stopping on the data (early), on the trip count (late), not running at all
(``M == 0``, initial ``cond`` false), a body reading outer-scope tensors and its iteration
number, and a while loop without ``M``.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import grape_tvm
from conftest import affine_loop_inputs as _affine_inputs
from conftest import affine_loop_steps as _ort_steps
from conftest import onnxruntime_outputs
from grape_tvm.cli import main
from grape_tvm.onnx_loop import OnnxLoopError, compile_onnx_loop, split_loop

info = helper.make_tensor_value_info
DIMS = {"n": (1, 64)}
SIZES = (1, 7, 64)


def _model(nodes, inputs, outputs, inits=(), name="g", check=True) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


def _const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.array(value, dtype), name)


def affine_loop() -> onnx.ModelProto:
    """``x = x * a + b`` while ``sum(x) <= thr``, at most ``M`` times; ``b`` is a graph
    input and ``a``, ``thr`` initializers, all read by the body from the outer scope."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["x_in", "a"], ["xa"]),
         helper.make_node("Add", ["xa", "b"], ["x_out"]),
         helper.make_node("ReduceSum", ["x_out"], ["s"], keepdims=0),
         helper.make_node("LessOrEqual", ["s", "thr"], ["c_out"])],
        "body", [info("i", TensorProto.INT64, []), info("c_in", TensorProto.BOOL, []),
                 info("x_in", TensorProto.FLOAT, ["n"])],
        [info("c_out", TensorProto.BOOL, []), info("x_out", TensorProto.FLOAT, ["n"])])
    return _model(
        [helper.make_node("Loop", ["M", "cond", "x"], ["y"], body=body, name="affine")],
        [info("M", TensorProto.INT64, []), info("cond", TensorProto.BOOL, []),
         info("x", TensorProto.FLOAT, ["n"]), info("b", TensorProto.FLOAT, ["n"])],
        [info("y", TensorProto.FLOAT, ["n"])],
        [_const("a", 1.25), _const("thr", 500.0)])


def counter_loop() -> onnx.ModelProto:
    """A while loop (no ``M``; cond from a Constant node, ``x`` through an Identity) over
    two carried values: ``h = tanh(h @ w + i)``, ``k = k + 1``; stops once ``max(h) > t``
    (``t`` an input) or after ``limit`` steps (an initializer): the body reads its
    iteration number and an outer-scope weight."""
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h_in", "w"], ["hw"]),
         helper.make_node("Cast", ["i"], ["fi"], to=TensorProto.FLOAT),
         helper.make_node("Mul", ["fi", "eps"], ["fi_eps"]),
         helper.make_node("Add", ["hw", "fi_eps"], ["pre"]),
         helper.make_node("Tanh", ["pre"], ["h_out"]),
         helper.make_node("Add", ["k_in", "one"], ["k_out"]),
         helper.make_node("ReduceMax", ["h_out"], ["m"], keepdims=0),
         helper.make_node("LessOrEqual", ["m", "t"], ["below"]),
         helper.make_node("Less", ["k_out", "limit"], ["more"]),
         helper.make_node("And", ["below", "more"], ["c_out"])],
        "body", [info("i", TensorProto.INT64, []), info("c_in", TensorProto.BOOL, []),
                 info("h_in", TensorProto.FLOAT, ["n", 8]), info("k_in", TensorProto.INT64, [])],
        [info("c_out", TensorProto.BOOL, []), info("h_out", TensorProto.FLOAT, ["n", 8]),
         info("k_out", TensorProto.INT64, [])])
    w = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32) * 0.6
    true = numpy_helper.from_array(np.array(True), "true_value")
    return _model(
        [helper.make_node("Constant", [], ["go"], value=true),
         helper.make_node("Identity", ["h0"], ["h_init"]),
         helper.make_node("Loop", ["", "go", "h_init", "k0"], ["h_final", "k_final"], body=body,
                          name="counter"),
         helper.make_node("Identity", ["k_final"], ["steps"])],
        [info("h0", TensorProto.FLOAT, ["n", 8]), info("t", TensorProto.FLOAT, [])],
        [info("h_final", TensorProto.FLOAT, ["n", 8]), info("steps", TensorProto.INT64, [])],
        [numpy_helper.from_array(w, "w"), _const("eps", 0.05), _const("k0", 0, np.int64),
         _const("one", 1, np.int64), _const("limit", 40, np.int64)])


def bias_loop() -> onnx.ModelProto:
    """``x = x + mean(v)`` while ``sum(x) < 100``, at most ``M`` times: the body reads ``v``,
    an outer input whose length ``m`` is not the state's ``n``."""
    body = helper.make_graph(
        [helper.make_node("ReduceMean", ["v"], ["mv"], keepdims=0),
         helper.make_node("Add", ["x_in", "mv"], ["x_out"]),
         helper.make_node("ReduceSum", ["x_out"], ["s"], keepdims=0),
         helper.make_node("Less", ["s", "hundred"], ["c_out"])],
        "body", [info("i", TensorProto.INT64, []), info("c_in", TensorProto.BOOL, []),
                 info("x_in", TensorProto.FLOAT, ["n"])],
        [info("c_out", TensorProto.BOOL, []), info("x_out", TensorProto.FLOAT, ["n"])])
    return _model(
        [helper.make_node("Loop", ["M", "", "x"], ["y"], body=body, name="bias")],
        [info("M", TensorProto.INT64, []), info("x", TensorProto.FLOAT, ["n"]),
         info("v", TensorProto.FLOAT, ["m"])],
        [info("y", TensorProto.FLOAT, ["n"])], [_const("hundred", 100.0)])


def _compile(model, tmp_path, name, dims=DIMS, **kwargs):
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    artifact = grape_tvm.compile_onnx(path, dims, "llvm", **kwargs).export(tmp_path / f"{name}.grape")
    return path, artifact


@pytest.fixture(scope="module")
def affine(tmp_path_factory):
    return _compile(affine_loop(), tmp_path_factory.mktemp("affine"), "affine")


@pytest.fixture(scope="module")
def counter(tmp_path_factory):
    return _compile(counter_loop(), tmp_path_factory.mktemp("counter"), "counter")


def _check(onnx_path, loop, inputs, rtol=1e-6, atol=1e-6):
    got = loop.run(inputs)
    want = onnxruntime_outputs(onnx_path, inputs)
    assert list(got) == [o.name for o in onnx.load(str(onnx_path)).graph.output]
    for value, ref in zip(got.values(), want):
        assert value.shape == ref.shape and value.dtype == ref.dtype
        np.testing.assert_allclose(value, ref, rtol=rtol, atol=atol)
    return got


@pytest.mark.parametrize("n", SIZES)
def test_data_dependent_stop_comes_first(affine, n):
    """``M`` is large: the loop stops after the step whose sum passes the threshold."""
    onnx_path, artifact = affine
    inputs = _affine_inputs(n, 10_000)
    with grape_tvm.load_onnx_loop(artifact, "cpu") as loop:
        _check(onnx_path, loop, inputs, rtol=1e-5)
        assert loop.steps == _ort_steps(inputs["x"], inputs["b"], 10_000) < 10_000
        assert loop.steps > 1 and loop.mode == "host"


@pytest.mark.parametrize("n", SIZES)
def test_trip_count_comes_first(affine, n):
    """``M`` below the data's stop: exactly ``M`` steps."""
    onnx_path, artifact = affine
    inputs = _affine_inputs(n, 10_000)
    free = _ort_steps(inputs["x"], inputs["b"], 10_000)
    with grape_tvm.load_onnx_loop(artifact, "cpu") as loop:
        for trip in (1, free - 1, free):
            if trip < 1:
                continue
            inputs["M"] = np.array(trip, np.int64)
            _check(onnx_path, loop, inputs, rtol=1e-5)
            assert loop.steps == trip


@pytest.mark.parametrize("n", SIZES)
def test_zero_iterations_return_the_initial_values(affine, n):
    onnx_path, artifact = affine
    with grape_tvm.load_onnx_loop(artifact, "cpu") as loop:
        for inputs in (_affine_inputs(n, 0), _affine_inputs(n, 50, cond=False)):
            got = _check(onnx_path, loop, inputs)
            assert loop.steps == 0 and loop.launches == 0
            np.testing.assert_array_equal(got["y"], inputs["x"])


@pytest.mark.parametrize("n", SIZES)
def test_while_loop_reads_its_iteration_number_and_outer_weights(counter, n):
    """No trip count: the stop comes from the data (large ``t``: from the counter limit)."""
    onnx_path, artifact = counter
    h0 = np.random.default_rng(n).standard_normal((n, 8)).astype(np.float32)
    with grape_tvm.load_onnx_loop(artifact, "cpu") as loop:
        seen = set()
        for t in (0.9, 0.999, 5.0):
            got = _check(onnx_path, loop, {"h0": h0, "t": np.array(t, np.float32)},
                         rtol=1e-5, atol=1e-5)
            assert int(got["steps"]) == loop.steps
            seen.add(loop.steps)
        assert 40 in seen and len(seen) >= 2  # stopped by the data and by the counter


def test_invariants_of_their_own_sizes_change_between_runs(tmp_path):
    """``v``'s length and values change while the state's shape stays: each run reads the
    ``v`` it was given (on a GPU: the loop graph is rebuilt when ``v``'s shape changes)."""
    onnx_path, artifact = _compile(bias_loop(), tmp_path, "bias", {"n": (1, 16), "m": (1, 32)})
    rng = np.random.default_rng(1)
    x = rng.random(5).astype(np.float32)
    with grape_tvm.load_onnx_loop(artifact, "cpu") as loop:
        steps = []
        for m, scale in ((3, 1.0), (32, 4.0), (3, 9.0), (1, 0.5)):
            v = (rng.random(m) * scale).astype(np.float32)
            _check(onnx_path, loop, {"M": np.array(500, np.int64), "x": x, "v": v}, rtol=1e-5)
            steps.append(loop.steps)
        assert len(set(steps)) == len(steps)


def test_while_loop_past_its_step_limit_is_an_error(tmp_path):
    onnx_path, artifact = _compile(counter_loop(), tmp_path, "limited", max_steps=5)
    h0 = np.zeros((3, 8), np.float32)
    with grape_tvm.load_onnx_loop(artifact, "cpu") as loop:
        with pytest.raises(RuntimeError, match="'counter' has no trip count M and its "
                                               "condition is still true after the step limit of 5"):
            loop.run({"h0": h0, "t": np.array(5.0, np.float32)})
        got = loop.run({"h0": h0, "t": np.array(5.0, np.float32)}, max_steps=100)
        assert loop.steps == 40 and int(got["steps"]) == 40


def test_cli_compiles_and_runs_a_loop_like_onnxruntime(tmp_path, capsys):
    onnx_path = tmp_path / "affine.onnx"
    onnx.save(affine_loop(), str(onnx_path))
    artifact = tmp_path / "affine.grape"
    assert main(["compile", str(onnx_path), "-o", str(artifact), "--dim", "n=1:64"]) == 0
    for n, trip in ((5, 3), (33, 10_000), (2, 0)):
        inputs = _affine_inputs(n, trip)
        np.savez(tmp_path / "in.npz", **inputs)
        assert main(["run", str(artifact), "--inputs", str(tmp_path / "in.npz"),
                     "--outputs", str(tmp_path / "out.npz")]) == 0
        with np.load(tmp_path / "out.npz") as npz:
            assert npz.files == ["y"]
            np.testing.assert_allclose(npz["y"], onnxruntime_outputs(onnx_path, inputs)[0],
                                       rtol=1e-5)
        assert f"after {_ort_steps(inputs['x'], inputs['b'], trip)} loop step(s)" in \
            capsys.readouterr().out
    np.savez(tmp_path / "in.npz", **{**_affine_inputs(65, 3)})
    assert main(["run", str(artifact), "--inputs", str(tmp_path / "in.npz"),
                 "--outputs", str(tmp_path / "out.npz")]) == 2
    assert "outside its declared range 1..64" in capsys.readouterr().err


def test_inspect_describes_the_graph_run_takes_and_the_trip_count(tmp_path, capsys):
    """An ONNX Loop's inputs and outputs as ``run`` takes and returns them (the graph's, not
    the loop step's internal ones), and its stop as the trip count M decides it
    (``max_steps`` bounds only a Loop without M)."""
    onnx_path = tmp_path / "affine.onnx"
    onnx.save(affine_loop(), str(onnx_path))
    artifact = tmp_path / "affine.grape"
    assert main(["compile", str(onnx_path), "-o", str(artifact), "--dim", "n=1:64"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(artifact), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in described["inputs"]] == ["M", "cond", "x", "b"]
    assert [t["name"] for t in described["outputs"]] == ["y"]
    assert main(["inspect", str(artifact)]) == 0
    text = capsys.readouterr().out
    assert "loop (an ONNX Loop): state" in text and "after its trip count M" in text
    assert "grape_loop_iter:" not in text


def test_loop_compiles_for_cuda(tmp_path):
    """No GPU needed: the step's kernels are built (and cubins when nvcc is here)."""
    module = grape_tvm.compile_onnx(affine_loop(), DIMS, "cuda")
    assert module.target["kind"] == "cuda"
    assert module.loop["carried"][:2] == ["grape_loop_iter", "grape_loop_cond"]
    assert module.loop["stop"] == "grape_stop" and module.loop["onnx"]["node"] == "affine"
    assert module.plan["host_steps"] == [] and module.plan["regions"]
    assert module.export(tmp_path / "affine_cuda.grape").stat().st_size > 0


# -- unsupported forms: one clear error naming the node ---------------------------------

def _body(nodes, carried_out_shape=("n",), extra_outputs=()):
    return helper.make_graph(
        nodes, "body", [info("i", TensorProto.INT64, []), info("c_in", TensorProto.BOOL, []),
                        info("x_in", TensorProto.FLOAT, ["n"])],
        [info("c_out", TensorProto.BOOL, []),
         info("x_out", TensorProto.FLOAT, list(carried_out_shape)), *extra_outputs])


def _loop_model(body, outputs=("y",), extra=(), name="L"):
    return _model(
        [*extra, helper.make_node("Loop", ["M", "", "x"], list(outputs), body=body, name=name)],
        [info("M", TensorProto.INT64, []), info("x", TensorProto.FLOAT, ["n"])],
        [info(o, TensorProto.FLOAT, ["k"]) for o in outputs], check=False)


def test_unsupported_loops_name_the_node():
    step = [helper.make_node("Identity", ["c_in"], ["c_out"])]
    scan = _body([*step, helper.make_node("Neg", ["x_in"], ["x_out"]),
                  helper.make_node("Identity", ["x_in"], ["seen"])],
                 extra_outputs=[info("seen", TensorProto.FLOAT, ["n"])])
    with pytest.raises(OnnxLoopError, match=r"Loop node 'L' has 1 scan output\(s\) \['seen'\]"):
        split_loop(_loop_model(scan, outputs=("y", "ys")))

    growing = _body([*step, helper.make_node("Concat", ["x_in", "x_in"], ["x_out"], axis=0)],
                    carried_out_shape=("m",))
    with pytest.raises(OnnxLoopError, match=r"Loop node 'L': carried value #0 \('x'.*keep each "
                                            "carried value's shape and dtype fixed"):
        compile_onnx_loop(_loop_model(growing), DIMS)

    inner = _body([*step, helper.make_node("Neg", ["x_in"], ["x_out"])])
    nested = _body([*step, helper.make_node("Loop", ["M", "", "x_in"], ["x_out"], body=inner,
                                            name="inner")])
    with pytest.raises(OnnxLoopError, match="Loop node 'L': its body holds Loop node 'inner'"):
        split_loop(_loop_model(nested))

    plain = _body([*step, helper.make_node("Neg", ["x_in"], ["x_out"])])
    beside = _model(
        [helper.make_node("Relu", ["x"], ["r"], name="relu0"),
         helper.make_node("Loop", ["M", "", "r"], ["y"], body=plain, name="L")],
        [info("M", TensorProto.INT64, []), info("x", TensorProto.FLOAT, ["n"])],
        [info("y", TensorProto.FLOAT, ["n"])])
    with pytest.raises(OnnxLoopError, match=r"node 'relu0' \(Relu\) is next to Loop node 'L'"):
        grape_tvm.compile_onnx(beside, DIMS)


def test_tvm_alone_rejects_loop():
    from tvm.relax.frontend.onnx import from_onnx  # pylint: disable=import-outside-toplevel

    with pytest.raises(Exception, match="Loop"):
        from_onnx(affine_loop())


def test_dim_param_that_is_not_an_identifier(tmp_path):
    """A Loop whose state's axis is named "n items" (TVM's importer would read "nitems"):
    declared and run under the model's own name."""
    model = affine_loop()
    for graph in (model.graph, model.graph.node[0].attribute[0].g):
        for value in (*graph.input, *graph.output):
            for dim in value.type.tensor_type.shape.dim:
                if dim.dim_param == "n":
                    dim.dim_param = "n items"
    onnx_path, artifact = _compile(model, tmp_path, "affine_items", dims={"n items": (1, 64)})
    inputs = _affine_inputs(7, 10_000)
    with grape_tvm.load_onnx_loop(artifact, "cpu") as loop:
        _check(onnx_path, loop, inputs, rtol=1e-5)
        assert loop.signature.dims == {"n items": grape_tvm.runtime.ShapeRange(1, 64)}
