"""Shapes given by tensors computed at run time (grape_tvm/onnx_shape_tensors.py and
passes/shape_tensors.py): Reshape to a shape input, Reduce* over axes fed at run time,
ConstantOfShape of a shape input, an exporter's shape arithmetic folded back into dims,
each against onnxruntime at several inputs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm_ffi.structural import structural_equal

import grape_tvm
from conftest import onnxruntime_outputs
from grape_tvm.onnx_shape_tensors import REDUCE_OPS
from grape_tvm.passes import FoldShapeTensors

info = helper.make_tensor_value_info


def _model(nodes, inputs, outputs, opset: int = 18, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "m", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def _executor(model, tmp_path, dims=None):
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    module = grape_tvm.compile_onnx(path, dims=dims or {})
    return path, module, grape_tvm.load(module.export(tmp_path / "m.grape"))


def _equal_onnxruntime(path, executor, feeds_list, rtol=1e-5, atol=1e-6) -> None:
    for feeds in feeds_list:
        got = list(executor.run(feeds).values())
        for value, ref in zip(got, onnxruntime_outputs(path, feeds)):
            assert value.shape == ref.shape and value.dtype == ref.dtype, (feeds, value.shape)
            np.testing.assert_allclose(value, ref, rtol=rtol, atol=atol)


def test_reshape_to_a_shape_fed_at_run_time(tmp_path):
    """TVM's converter wanted the shape as a constant. Its 0 (copy) and -1 (the rest)."""
    model = _model([helper.make_node("Reshape", ["x", "s"], ["y"])],
                   [info("x", TensorProto.FLOAT, [2, 3, 4]), info("s", TensorProto.INT64, [3])],
                   [info("y", TensorProto.FLOAT, None)])
    path, _, executor = _executor(model, tmp_path)
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    _equal_onnxruntime(path, executor, [{"x": x, "s": np.array(s, np.int64)}
                                        for s in ([4, 3, 2], [0, -1, 2], [-1, 1, 1], [2, 0, 4])])


def test_reshape_to_a_run_time_shape_that_does_not_fit_fails_clearly(tmp_path):
    """onnxruntime refuses these; unchecked, grape read past the data ([5, 7] of 24)."""
    model = _model([helper.make_node("Reshape", ["x", "s"], ["y"])],
                   [info("x", TensorProto.FLOAT, [2, 3, 4]), info("s", TensorProto.INT64, [2])],
                   [info("y", TensorProto.FLOAT, None)])
    _, _, executor = _executor(model, tmp_path)
    x = np.zeros((2, 3, 4), np.float32)
    for shape in ([5, 7], [-1, 5], [-1, -1], [-2, -12]):
        with pytest.raises(Exception, match="must keep the element count"):
            executor.run({"x": x, "s": np.array(shape, np.int64)})


def test_reduce_mean_over_run_time_axes_of_integers_and_of_nothing(tmp_path):
    """Integers: the mean truncated toward 0 (onnxruntime's -4 / 3 is -1); an empty float
    slice: 0, as onnxruntime and grape's mean over constant axes."""
    for dtype, onnx_type, x in ((np.int32, TensorProto.INT32,
                                 np.array([[-7, 2, 1], [5, -3, -4]], np.int32)),
                                (np.float32, TensorProto.FLOAT, np.zeros((0, 3), np.float32))):
        node = helper.make_node("ReduceMean", ["x", "axes"], ["y"], keepdims=1)
        model = _model([node], [info("x", onnx_type, list(x.shape)),
                                info("axes", TensorProto.INT64, [1])],
                       [info("y", onnx_type, None)])
        path, _, executor = _executor(model, tmp_path)
        _equal_onnxruntime(path, executor, [{"x": x, "axes": np.array([a], np.int64)}
                                            for a in (0, 1)])


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_over_axes_fed_at_run_time(op, tmp_path):
    """One artifact, other axes at each call (negative ones too), kept or dropped dims."""
    rng = np.random.default_rng(1)
    for keepdims in (1, 0):
        node = helper.make_node(op, ["x", "axes"], ["y"], keepdims=keepdims)
        model = _model([node], [info("x", TensorProto.FLOAT, [3, 4, 5]),
                                info("axes", TensorProto.INT64, [2])],
                       [info("y", TensorProto.FLOAT, None)])
        path, _, executor = _executor(model, tmp_path)
        x = rng.random((3, 4, 5)).astype(np.float32) + 0.5
        _equal_onnxruntime(path, executor, [{"x": x, "axes": np.array(a, np.int64)}
                                            for a in ([0, 2], [1, -1], [-3, 1])])


def test_bool_reduce_max_min_over_run_time_axes_are_any_and_all(tmp_path):
    for op in ("ReduceMax", "ReduceMin"):
        node = helper.make_node(op, ["x", "axes"], ["y"], keepdims=1)
        model = _model([node], [info("x", TensorProto.BOOL, [2, 3]),
                                info("axes", TensorProto.INT64, [1])],
                       [info("y", TensorProto.BOOL, None)], opset=20)
        _, _, executor = _executor(model, tmp_path)
        x = np.array([[True, False, True], [True, True, True]])
        for axis in (0, 1):
            want = (x.any if op == "ReduceMax" else x.all)(axis=axis, keepdims=True)
            got = executor.run({"x": x, "axes": np.array([axis], np.int64)})["y"]
            np.testing.assert_array_equal(got, want)


def test_reduce_over_repeated_run_time_axes_fails_clearly(tmp_path):
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)
    model = _model([node], [info("x", TensorProto.FLOAT, [3, 4]),
                            info("axes", TensorProto.INT64, [2])],
                   [info("y", TensorProto.FLOAT, None)])
    _, _, executor = _executor(model, tmp_path)
    with pytest.raises(Exception, match="its axes must be distinct axes of a rank-2 input"):
        executor.run({"x": np.ones((3, 4), np.float32), "axes": np.array([1, -1], np.int64)})


def test_constant_of_a_shape_fed_at_run_time(tmp_path):
    value = numpy_helper.from_array(np.array([7], np.int32), "value")
    model = _model([helper.make_node("ConstantOfShape", ["s"], ["y"], value=value)],
                   [info("s", TensorProto.INT64, [2])], [info("y", TensorProto.INT32, None)])
    path, _, executor = _executor(model, tmp_path)
    _equal_onnxruntime(path, executor, [{"s": np.array(s, np.int64)} for s in ([2, 3], [1, 0])])


@pytest.mark.parametrize("empty", ["initializer", "shape_of_a_scalar", "no_value"])
def test_constant_of_the_empty_shape_is_a_scalar(empty, tmp_path):
    """transformers' attention mask: ``ConstantOfShape(Shape(scalar))``. TVM broadcast the
    one-element value to rank 0 and failed the import. Without ``value``: a float 0."""
    value = {} if empty == "no_value" else \
        {"value": numpy_helper.from_array(np.array([-2.5], np.float32), "value")}
    nodes = [helper.make_node("ConstantOfShape", ["s"], ["c"], **value),
             helper.make_node("Add", ["x", "c"], ["y"])]
    inputs, inits = [info("x", TensorProto.FLOAT, ["n"])], []
    if empty != "shape_of_a_scalar":
        inits = [numpy_helper.from_array(np.zeros(0, np.int64), "s")]
    else:
        nodes.insert(0, helper.make_node("Shape", ["t"], ["s"]))
        inputs.append(info("t", TensorProto.FLOAT, []))
    model = _model(nodes, inputs, [info("y", TensorProto.FLOAT, None)], inits=inits)
    path, _, executor = _executor(model, tmp_path, dims={"n": (1, 16)})
    extra = {"t": np.array(3.0, np.float32)} if empty == "shape_of_a_scalar" else {}
    _equal_onnxruntime(path, executor, [{"x": np.arange(n, dtype=np.float32), **extra}
                                        for n in (1, 5, 16)])


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Mod"])
@pytest.mark.parametrize("constant, dim_first", [
    (np.array([6], np.int64), False),  # the dynamo exporter's arange [0] + past
    (np.array([6], np.int64), True),
    (np.array([[6]], np.int64), False),  # rank 2
    (np.array([6], np.int32), False),  # the dim cast to int32 first
])
def test_a_one_element_tensor_with_a_dim_keeps_its_rank(op, constant, dim_first, tmp_path):
    """``Add(arange [0], past)`` is a 1-d tensor. TVM folded it into the scalar ``past``; an
    ``Unsqueeze`` of it then failed (axis out of range). The result is unsqueezed to rank
    3 and multiplies ``x``: its rank decides the output's."""
    dim = "dim" if constant.dtype == np.int64 else "dim32"
    operands = [dim, "constant"] if dim_first else ["constant", dim]
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=1, end=2),
             helper.make_node("Squeeze", ["s"], ["dim"]),
             helper.make_node("Cast", ["dim"], ["dim32"], to=TensorProto.INT32),
             helper.make_node(op, operands, ["ids"]),
             helper.make_node("Unsqueeze", ["ids", "axes"], ["u"]),
             helper.make_node("Cast", ["u"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["x", "f"], ["y"])]
    axes = [0, 1] if constant.ndim == 1 else [0]
    inits = [numpy_helper.from_array(constant, "constant"),
             numpy_helper.from_array(np.array(axes, np.int64), "axes")]
    model = _model(nodes, [info("x", TensorProto.FLOAT, ["b", "p"])],
                   [info("y", TensorProto.FLOAT, None)], inits=inits)
    path, _, executor = _executor(model, tmp_path, dims={"b": (1, 4), "p": (1, 32)})
    _equal_onnxruntime(path, executor, [{"x": np.full((b, p), 0.5, np.float32)}
                                        for b, p in ((1, 1), (2, 5), (4, 32))])


@pytest.mark.parametrize("target", [[-1], [1], [], [1, 1]])
def test_reshape_of_a_dim(target, tmp_path):
    """The dynamo exporter's ``Reshape(Shape(k)[2] + 1, [-1])``, concatenated into the shape
    of an ``Expand``. TVM's reshape refused the dim (a scalar to it): "Reshape expects the
    input data to be a Tensor"."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=1, end=2),
             helper.make_node("Squeeze", ["s"], ["dim"]),
             helper.make_node("Add", ["dim", "one"], ["next"]),  # p + 1
             helper.make_node("Reshape", ["next", "target"], ["r"])]
    if len(target) == 1:  # x's first column expanded to [b, p + 1]
        nodes += [helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["column"]),
                  helper.make_node("Shape", ["x"], ["b"], start=0, end=1),
                  helper.make_node("Concat", ["b", "r"], ["shape"], axis=0),
                  helper.make_node("Expand", ["column", "shape"], ["y"])]
    else:  # x times p + 1, as a scalar or a [1, 1] tensor
        nodes += [helper.make_node("Cast", ["r"], ["f"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", ["x", "f"], ["y"])]
    inits = [numpy_helper.from_array(np.array(value, np.int64), name) for name, value in
             [("one", 1), ("target", target), ("starts", [0]), ("ends", [1]), ("axes", [1])]]
    model = _model(nodes, [info("x", TensorProto.FLOAT, ["b", "p"])],
                   [info("y", TensorProto.FLOAT, None)], inits=inits)
    path, _, executor = _executor(model, tmp_path, dims={"b": (1, 4), "p": (1, 32)})
    _equal_onnxruntime(path, executor, [{"x": np.arange(b * p, dtype=np.float32).reshape(b, p)}
                                        for b, p in ((1, 1), (2, 5), (4, 31))])


def test_gather_of_a_shape_by_a_constant_vector(tmp_path):
    """onnxruntime's transpose optimizer in Llama's rotary half: the head size read as
    ``Gather(Gather(Shape(k), [0, 2, 1, 3]), 3)``, halved, ends a ``Slice``. TVM gathered
    the shape as a run-time tensor; the slice's extent was lost and the next ``Shape`` of it
    failed ("shape_of expects a tensor input")."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "perm"], ["permuted"], axis=0),
             helper.make_node("Gather", ["permuted", "three"], ["head"], axis=0),
             helper.make_node("Div", ["head", "two"], ["half"]),
             helper.make_node("Unsqueeze", ["half", "zero"], ["end"]),
             helper.make_node("Slice", ["x", "zero", "end", "three_1d"], ["y"]),
             helper.make_node("Shape", ["y"], ["t"]),
             helper.make_node("Gather", ["t", "three"], ["width"], axis=0),
             helper.make_node("Cast", ["width"], ["w"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["y", "w"], ["z"])]
    inits = [numpy_helper.from_array(np.array(value, np.int64), name) for name, value in
             [("perm", [0, 2, 1, 3]), ("three", 3), ("two", 2), ("zero", [0]),
              ("three_1d", [3])]]
    model = _model(nodes, [info("x", TensorProto.FLOAT, ["b", 2, "p", 16])],
                   [info("z", TensorProto.FLOAT, None)], inits=inits)
    path, _, executor = _executor(model, tmp_path, dims={"b": (1, 4), "p": (1, 32)})
    _equal_onnxruntime(path, executor, [
        {"x": np.arange(b * 2 * p * 16, dtype=np.float32).reshape(b, 2, p, 16)}
        for b, p in ((1, 1), (2, 5), (4, 32))])


def make_head_split_model() -> onnx.ModelProto:
    """``y = Reshape(x, Concat(Shape(x)[:2], [heads], Div(Shape(x)[2:], heads)))`` with
    ``heads = Div(Shape(h)[0:1], [2])``: an attention export's shape arithmetic (Div, a
    Concat of shapes with computed tensors) over dynamic dims."""
    nodes = [
        helper.make_node("Shape", ["x"], ["lead"], start=0, end=2),
        helper.make_node("Shape", ["x"], ["width"], start=2, end=3),
        helper.make_node("Shape", ["h"], ["hs"], start=0, end=1),
        helper.make_node("Div", ["hs", "two"], ["heads"]),
        helper.make_node("Div", ["width", "heads"], ["size"]),
        helper.make_node("Concat", ["lead", "heads", "size"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    return _model(nodes, [info("x", TensorProto.FLOAT, ["b", "s", 8]),
                          info("h", TensorProto.FLOAT, ["m"])],
                  [info("y", TensorProto.FLOAT, None)],
                  inits=[numpy_helper.from_array(np.array([2], np.int64), "two")])


def test_shape_arithmetic_folds_into_the_inputs_dims(tmp_path):
    """The target shape is ``[b, s, m // 2, 8 // (m // 2)]``, computed in tensors at run
    time by the export: folded into those expressions, no dim is read back on the host (the
    element-count check of a reshape to a computed shape stays there)."""
    path, module, executor = _executor(make_head_split_model(), tmp_path,
                                       {"b": (1, 4), "s": (1, 16), "m": (2, 16)})
    # Only the reshape's element-count check stays on the host, no shape read back.
    assert [step["op"] for step in module.plan["host_steps"]] == ["relax.run.assert_op"]
    rng = np.random.default_rng(2)
    _equal_onnxruntime(path, executor, [{"x": rng.random((b, s, 8)).astype(np.float32),
                                         "h": np.zeros(m, np.float32)}
                                        for b, s, m in ((1, 1, 8), (2, 5, 4), (4, 16, 16))])


def _heads_module() -> tvm.IRModule:
    """The pass's docstring example: ``x: (b, 2, 2)`` reshaped to ``[b, 8] // [1, 2]``, read
    back from a tensor into fresh dims ``x_0, x_1``."""
    b = tvm.tirx.Var("b", "int64")
    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([b, 2, 2], "float32"))
    with builder.function("main", [x]):
        with builder.dataflow():
            n = builder.emit(relax.op.shape_to_tensor(relax.ShapeExpr([b, 8])))
            heads = builder.emit(relax.op.floor_divide(n, relax.const([1, 2], "int64")))
            read = builder.emit(relax.op.tensor_to_shape(heads))
            fresh = [tvm.tirx.Var(f"x_{i}", "int64") for i in range(2)]
            shape = builder.match_cast(read, relax.ShapeType(fresh))
            y = builder.emit_output(relax.op.reshape(x, shape))
        builder.emit_func_output(y)
    return builder.get()


def test_fold_shape_tensors_on_a_tiny_module():
    mod = _heads_module()
    assert "tensor_to_shape" in mod.script()
    folded = FoldShapeTensors()(mod)
    text = folded.script()
    assert "tensor_to_shape" not in text and "x_0" not in text
    assert str(folded["main"].ret_ty) == 'R.Tensor((b, 4), dtype="float32")'
    vm = relax.VirtualMachine(tvm.compile(folded, "llvm"), tvm.cpu())
    for rows in (1, 3):
        x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 2, 2)
        np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(),
                                      x.reshape(rows, 4))


def test_fold_shape_tensors_keeps_a_tensor_it_cannot_evaluate():
    """A shape read from an input's values stays a run-time read."""
    builder = relax.BlockBuilder()
    s = relax.Var("s", relax.TensorType([2], "int64"))
    with builder.function("main", [s]):
        with builder.dataflow():
            read = builder.emit(relax.op.tensor_to_shape(s))
            shape = builder.match_cast(read, relax.ShapeType(
                [tvm.tirx.Var("x_0", "int64"), tvm.tirx.Var("x_1", "int64")]))
            y = builder.emit_output(relax.op.zeros(shape, "float32"))
        builder.emit_func_output(y)
    mod = builder.get()
    assert structural_equal(FoldShapeTensors()(mod), mod)


def _cast_module(target) -> tvm.IRModule:
    """``x: (b, 2, 2)`` reshaped to ``[b, 4]`` read back from a tensor into ``target(b, n)``
    (``n``: the other parameter's dim)."""
    b, n = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("n", "int64")
    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([b, 2, 2], "float32"))
    z = relax.Var("z", relax.TensorType([n], "float32"))
    with builder.function("main", [x, z]):
        with builder.dataflow():
            values = builder.emit(relax.op.shape_to_tensor(relax.ShapeExpr([b, 4])))
            read = builder.emit(relax.op.tensor_to_shape(values))
            shape = builder.match_cast(read, relax.ShapeType(target(b, n)))
            y = builder.emit_output(relax.op.reshape(x, shape))
        builder.emit_func_output(y)
    return builder.get()


@pytest.mark.parametrize("target", [
    lambda b, n: [n, tvm.tirx.Var("k", "int64")],    # n is the input's: a run-time check
    lambda b, n: [tvm.tirx.Var("k", "int64")] * 2,   # k twice: the two must be equal
])
def test_fold_shape_tensors_keeps_casts_that_check(target):
    mod = _cast_module(target)
    assert structural_equal(FoldShapeTensors()(mod), mod)


def test_fold_shape_tensors_after_an_if_and_through_a_folded_shape():
    """Bindings inside an ``if`` before the fold stay; a shape computed from a folded one
    folds in the input's dims (not the first fold's, gone with its cast)."""
    b = tvm.tirx.Var("b", "int64")
    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([b, 2, 2], "float32"))
    flag = relax.Var("flag", relax.TensorType([], "bool"))
    with builder.function("main", [x, flag]):
        steps, last = [], x
        for i in range(4):
            var = relax.Var(f"t{i}", relax.TensorType([b, 2, 2], "float32"))
            steps.append(relax.VarBinding(var, relax.op.add(last, last)))
            last = var
        then = relax.SeqExpr([relax.BindingBlock(steps)], last)
        chosen = builder.emit(relax.If(flag, then, x))
        with builder.dataflow():
            first = builder.emit(relax.op.shape_to_tensor(relax.ShapeExpr([b, 4])))
            read = builder.emit(relax.op.tensor_to_shape(first))
            shape = builder.match_cast(read, relax.ShapeType(
                [tvm.tirx.Var("p_0", "int64"), tvm.tirx.Var("p_1", "int64")]))
            flat = builder.emit(relax.op.reshape(chosen, shape))
            again = builder.emit(relax.op.multiply(
                relax.op.shape_to_tensor(relax.ShapeExpr(list(flat.ty.shape.values))),
                relax.const([2, 1], "int64")))
            read2 = builder.emit(relax.op.tensor_to_shape(again))
            shape2 = builder.match_cast(read2, relax.ShapeType(
                [tvm.tirx.Var("q_0", "int64"), tvm.tirx.Var("q_1", "int64")]))
            zeros = builder.emit(relax.op.zeros(shape2, "float32"))
            y = builder.emit_output(relax.Tuple([flat, zeros]))
        builder.emit_func_output(y)
    folded = FoldShapeTensors()(builder.get())
    text = folded.script()
    assert "tensor_to_shape" not in text and "p_0" not in text and "q_0" not in text
    assert all(f"t{i}" in text for i in range(4)) and "R.shape([b * 2, 4])" in text, text


@pytest.mark.parametrize("with_tensor", [True, False])
def test_a_dim_returned_as_an_output_is_a_0d_int64_tensor(tmp_path, with_tensor):
    """``n = Shape(x)[0]`` as an output: the entry returns a value of the dims, not a
    tensor; it comes back as a 0-d int64 tensor (numpy array) on every call, beside a
    tensor output or alone (it failed: an int is not iterable)."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "i0"], ["n"])]
    outputs = [info("n", TensorProto.INT64, [])]
    if with_tensor:
        nodes.append(helper.make_node("Relu", ["x"], ["y"]))
        outputs.append(info("y", TensorProto.FLOAT, ["n"]))
    model = _model(nodes, [info("x", TensorProto.FLOAT, ["n"])], outputs,
                   inits=[numpy_helper.from_array(np.array(0, np.int64), "i0")])
    path, _, executor = _executor(model, tmp_path, {"n": (0, 8)})
    rng = np.random.default_rng(2)
    feeds = [{"x": rng.standard_normal(n).astype(np.float32)} for n in (3, 3, 5, 8, 0, 5)]
    _equal_onnxruntime(path, executor, feeds)
    for feed in feeds:
        got = executor.run(feed, return_numpy=False)
        assert isinstance(got["n"], tvm.runtime.Tensor) and got["n"].dtype == "int64"
        assert got["n"].numpy().shape == () and int(got["n"].numpy()) == len(feed["x"])
