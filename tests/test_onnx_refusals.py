"""ONNX nodes TVM's converters imported into wrong answers (onnx's node test suite,
``python -m grape_tvm.conformance``): each now equals onnxruntime (or, for semantics newer
than onnxruntime's opsets, onnx's reference implementation), or is refused naming the
operator, the node and the reason. grape_tvm/onnx_fixes.py has the converters."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import grape_tvm
from conftest import onnxruntime_outputs
from grape_tvm.frontend import ImportError_, import_onnx

info = helper.make_tensor_value_info


def _model(node, inputs, outputs, opset: int, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph([node], "m", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def _run(model, tmp_path, dims: dict, feeds_list) -> list[list[np.ndarray]]:
    """grape's outputs (compiled once for ``dims``, run on each feed), in graph order."""
    executor = grape_tvm.load(grape_tvm.compile_onnx(model, dims=dims).export(tmp_path / "m.grape"))
    names = [o.name for o in model.graph.output]
    return [[executor.run(feeds)[n] for n in names] for feeds in feeds_list]


def _equals_onnxruntime(model, tmp_path, dims: dict, feeds_list, rtol=1e-5, atol=1e-6) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    for feeds, got in zip(feeds_list, _run(model, tmp_path, dims, feeds_list)):
        for value, ref in zip(got, onnxruntime_outputs(path, feeds)):
            assert value.shape == ref.shape and value.dtype == ref.dtype
            np.testing.assert_allclose(value, ref, rtol=rtol, atol=atol)


def _refused(model, *words: str, dims: dict | None = None) -> None:
    with pytest.raises(ImportError_) as caught:
        grape_tvm.compile_onnx(model, dims=dims)
    message = str(caught.value)
    assert message.startswith("grape-tvm refuses graph 'm': ")
    for word in words:
        assert word in message


def test_bitshift_by_the_width_or_more_or_negative(tmp_path):
    """int32 ``-8 << 32`` was -8: LLVM leaves such shifts undefined. onnx (BitShift-28)
    gives 0, or the sign fill shifting right."""
    rng = np.random.default_rng(0)
    for direction in ("LEFT", "RIGHT"):
        node = helper.make_node("BitShift", ["x", "y"], ["z"], direction=direction)
        model = _model(node, [info("x", TensorProto.INT32, ["n"]), info("y", TensorProto.INT32, ["n"])],
                       [info("z", TensorProto.INT32, ["n"])], 28)
        feeds = [{"x": np.array([-8, 4, -1, 7], np.int32), "y": np.array([32, 33, -1, 3], np.int32)},
                 {"x": rng.integers(-1000, 1000, 9, np.int32), "y": rng.integers(-40, 40, 9, np.int32)}]
        reference = ReferenceEvaluator(model)
        for f, (got,) in zip(feeds, _run(model, tmp_path, {"n": (1, 16)}, feeds)):
            np.testing.assert_array_equal(got, reference.run(None, f)[0])


def test_float8_casts_are_refused_and_others_kept(tmp_path):
    """TVM's float8 conversions wrap (1e6 became -15 in e4m3fn), decode NaN to numbers and
    ignore ``round_mode``."""
    for source, target, opset in ((TensorProto.FLOAT, TensorProto.FLOAT8E4M3FN, 21),
                                  (TensorProto.FLOAT8E5M2, TensorProto.FLOAT, 21),
                                  (TensorProto.FLOAT, TensorProto.FLOAT8E8M0, 24)):
        node = helper.make_node("Cast", ["x"], ["y"], to=target)
        model = _model(node, [info("x", source, [4])], [info("y", target, [4])], opset)
        _refused(model, "Cast node '<output y>': Cast from", "is not supported")
    node = helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT16)
    model = _model(node, [info("x", TensorProto.FLOAT, ["n"])], [info("y", TensorProto.FLOAT16, ["n"])], 21)
    _equals_onnxruntime(model, tmp_path, {"n": (1, 8)},
                        [{"x": np.array([0.1, -2.5, 7e4, np.inf], np.float32)}])


def test_batchnorm_training_with_running_statistics_is_refused(tmp_path):
    """TVM updates the running mean and variance with the other momentum convention; ``Y``
    alone (normalized by the batch's own statistics) is right and still compiles."""
    params = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
              (("s", [1.0, 2.0]), ("b", [0.5, -1.0]), ("m", [0.0, 1.0]), ("v", [1.0, 4.0]))]
    inputs = [info("x", TensorProto.FLOAT, [3, 2, 4])]
    both = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"],
                            training_mode=1, name="bn")
    outputs = [info(n, TensorProto.FLOAT, None) for n in ("y", "rm", "rv")]
    _refused(_model(both, inputs, outputs, 15, params), "BatchNormalization node 'bn'", "training_mode=1")

    alone = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], training_mode=1)
    model = _model(alone, inputs, outputs[:1], 15, params)
    x = np.random.default_rng(1).standard_normal((3, 2, 4)).astype(np.float32)
    (y,), = _run(model, tmp_path, {}, [{"x": x}])
    mean, var = x.mean(axis=(0, 2), keepdims=True), x.var(axis=(0, 2), keepdims=True)
    scale, bias = np.array([1, 2], np.float32)[:, None], np.array([0.5, -1], np.float32)[:, None]
    np.testing.assert_allclose(y, (x - mean) / np.sqrt(var + 1e-5) * scale + bias, rtol=1e-5, atol=1e-5)


def test_conv_transpose_output_shape_sets_the_padding(tmp_path):
    """TVM ignored ``output_shape``: (3, 3) by strides (3, 2) to (10, 8) came out (9, 7)."""
    w = numpy_helper.from_array(np.random.default_rng(2).standard_normal((1, 2, 3, 3)).astype(np.float32), "w")
    for shape, auto_pad in (((10, 8), "NOTSET"), ((7, 6), "NOTSET"), ((9, 6), "SAME_UPPER")):
        node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[3, 2],
                                output_shape=list(shape), auto_pad=auto_pad)
        model = _model(node, [info("x", TensorProto.FLOAT, [1, 1, 3, 3])],
                       [info("y", TensorProto.FLOAT, None)], 17, [w])
        x = np.arange(9, dtype=np.float32).reshape(1, 1, 3, 3)
        _equals_onnxruntime(model, tmp_path, {}, [{"x": x}])


def test_dropout_mask_is_bool_and_training_is_refused(tmp_path):
    """TVM's mask was float32, and training mode was ignored (``y = x``)."""
    x_info, outputs = info("x", TensorProto.FLOAT, ["n", 4]), \
        [info("y", TensorProto.FLOAT, None), info("mask", TensorProto.BOOL, None)]
    rng = np.random.default_rng(3)
    inference = helper.make_node("Dropout", ["x"], ["y", "mask"])
    _equals_onnxruntime(_model(inference, [x_info], outputs, 13), tmp_path, {"n": (1, 8)},
                        [{"x": rng.standard_normal((n, 4)).astype(np.float32)} for n in (1, 5)])

    true = numpy_helper.from_array(np.array(True), "t")
    ratio = numpy_helper.from_array(np.array(0.5, np.float32), "r")
    training = helper.make_node("Dropout", ["x", "r", "t"], ["y", "mask"])
    _refused(_model(training, [x_info], outputs, 13, [true, ratio]), "Dropout node '<output y>'",
             "training_mode true", dims={"n": (1, 8)})

    model = _model(training, [x_info, info("t", TensorProto.BOOL, [])], outputs, 13, [ratio])
    executor = grape_tvm.load(grape_tvm.compile_onnx(model, dims={"n": (1, 8)}).export(tmp_path / "d.grape"))
    x = rng.standard_normal((2, 4)).astype(np.float32)
    result = executor.run({"x": x, "t": np.array(False)})
    np.testing.assert_array_equal(result["y"], x)
    assert result["mask"].dtype == np.bool_ and result["mask"].all()
    with pytest.raises(Exception, match="Dropout node '<output y>': Dropout with training_mode true"):
        executor.run({"x": x, "t": np.array(True)})


def test_expand_to_a_shape_tensor_broadcasts_both_ways(tmp_path):
    """A 1 in the shape where the input has 3 gave 1 (ONNX broadcasts both ways)."""
    node = helper.make_node("Expand", ["x", "shape"], ["y"])
    model = _model(node, [info("x", TensorProto.FLOAT, [3, 1]), info("shape", TensorProto.INT64, [3])],
                   [info("y", TensorProto.FLOAT, None)], 13)
    x = np.array([[1.0], [2.0], [3.0]], np.float32)
    _equals_onnxruntime(model, tmp_path, {}, [{"x": x, "shape": np.array(s, np.int64)}
                                              for s in ([2, 1, 6], [1, 3, 1], [4, 3, 2])])


def test_isinf_detects_one_sign_when_asked(tmp_path):
    """TVM ignored ``detect_positive``/``detect_negative``."""
    x = np.array([-1.7, np.nan, np.inf, -3.6, -np.inf, np.inf], np.float32)
    for flags in ({"detect_positive": 0}, {"detect_negative": 0}, {}):
        node = helper.make_node("IsInf", ["x"], ["y"], **flags)
        model = _model(node, [info("x", TensorProto.FLOAT, [6])], [info("y", TensorProto.BOOL, [6])], 20)
        _equals_onnxruntime(model, tmp_path, {}, [{"x": x}])


def test_layer_normalization_mean_and_inverse_std(tmp_path):
    """TVM returned 0-d placeholders for ``Mean`` and ``InvStdDev``."""
    rng = np.random.default_rng(4)
    scale = numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "s")
    node = helper.make_node("LayerNormalization", ["x", "s"], ["y", "mean", "inv"], axis=-2)
    outputs = [info(n, TensorProto.FLOAT, None) for n in ("y", "mean", "inv")]
    model = _model(node, [info("x", TensorProto.FLOAT, ["n", 3, 4])], outputs, 17, [scale])
    _equals_onnxruntime(model, tmp_path, {"n": (1, 8)},
                        [{"x": rng.standard_normal((n, 3, 4)).astype(np.float32)} for n in (1, 6)])


def test_layer_normalization_of_an_input_known_only_by_its_rank():
    """``Y`` alone of a LayerNormalization whose input TVM knows only by its rank (a
    broadcast of two symbolic dims) imports, as with TVM's converter: grape's read the
    input's shape for outputs nobody asked for, and failed."""
    add = helper.make_node("Add", ["a", "b"], ["x"])
    norm = helper.make_node("LayerNormalization", ["x", "s"], ["y"])
    scale = numpy_helper.from_array(np.ones(4, np.float32), "s")
    graph = helper.make_graph([add, norm], "m", [info("a", TensorProto.FLOAT, ["n", 4]),
                                                 info("b", TensorProto.FLOAT, ["m", 4])],
                              [info("y", TensorProto.FLOAT, None)], [scale])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    mod = import_onnx(model)
    assert mod["main"].ret_ty.ndim == 2


def test_mish_and_softplus_keep_precision_for_negative_inputs(tmp_path):
    """``log(1 + e^x)`` rounds ``1 + e^x``: Mish was off by 5.8e-7 (0.1%) at x = -10."""
    x = np.concatenate([np.linspace(-30, 30, 601), [-np.inf, np.inf, np.nan, 0.0, 100.0]]).astype(np.float32)
    for op, opset in (("Mish", 18), ("Softplus", 17)):
        node = helper.make_node(op, ["x"], ["y"])
        model = _model(node, [info("x", TensorProto.FLOAT, ["n"])], [info("y", TensorProto.FLOAT, ["n"])], opset)
        _equals_onnxruntime(model, tmp_path, {"n": (1, 1024)}, [{"x": x}, {"x": x[::7].copy()}],
                            rtol=1e-5, atol=1e-30)


def test_float_mod_at_infinities(tmp_path):
    """``-3 % inf`` was NaN (``x - floor(x / y) * y``); Mod-28 (float with ``fmod=0``,
    which onnxruntime 1.32 does not run) follows numpy: inf."""
    x = np.array([0.0, -3.0, 3.0, -1.0, 1.0, np.inf, 1.0, np.nan, 7.5, -7.5, 7.5], np.float32)
    y = np.array([-2.0, np.inf, np.inf, -np.inf, -np.inf, 2.0, 0.0, 2.0, -2.0, 2.0, 2.0], np.float32)
    node = helper.make_node("Mod", ["x", "y"], ["z"], fmod=0)
    model = _model(node, [info("x", TensorProto.FLOAT, ["n"]), info("y", TensorProto.FLOAT, ["n"])],
                   [info("z", TensorProto.FLOAT, ["n"])], 28)
    feeds = [{"x": x, "y": y}, {"x": x[5:], "y": y[5:]}]
    for f, (got,) in zip(feeds, _run(model, tmp_path, {"n": (1, 16)}, feeds)):
        with np.errstate(invalid="ignore", divide="ignore"):
            np.testing.assert_array_equal(got, np.mod(f["x"], f["y"]))


def test_nms_with_run_time_limits_is_refused(tmp_path):
    """TVM took 0 boxes for a ``max_output_boxes_per_class`` it could not read at import."""
    node = helper.make_node("NonMaxSuppression", ["boxes", "scores", "k"], ["selected"])
    inputs = [info("boxes", TensorProto.FLOAT, [1, 3, 4]), info("scores", TensorProto.FLOAT, [1, 1, 3])]
    outputs = [info("selected", TensorProto.INT64, None)]
    _refused(_model(node, inputs + [info("k", TensorProto.INT64, [1])], outputs, 11),
             "NonMaxSuppression node '<output selected>'", "max_output_boxes_per_class")
    k = numpy_helper.from_array(np.array([2], np.int64), "k")
    boxes = np.array([[[0, 0, 1, 1], [0, 0.1, 1, 1.1], [0, 10, 1, 11]]], np.float32)
    scores = np.array([[[0.9, 0.75, 0.6]]], np.float32)
    _equals_onnxruntime(_model(node, inputs, outputs, 11, [k]), tmp_path, {},
                        [{"boxes": boxes, "scores": scores}])


def test_roialign_max_is_refused():
    """TVM's max mode pools the bilinear samples, not onnx's weighted neighbours."""
    node = helper.make_node("RoiAlign", ["x", "rois", "idx"], ["y"], mode="max", output_height=2,
                            output_width=2)
    model = _model(node, [info("x", TensorProto.FLOAT, [1, 1, 4, 4]), info("rois", TensorProto.FLOAT, [1, 4]),
                          info("idx", TensorProto.INT64, [1])], [info("y", TensorProto.FLOAT, None)], 16)
    _refused(model, "RoiAlign node '<output y>'", 'mode="max"')


def test_space_to_depth_crd_orders_channels_first(tmp_path):
    """TVM ignored ``mode="CRD"`` (SpaceToDepth-28), ordering as DCR."""
    for mode in ("CRD", "DCR"):
        node = helper.make_node("SpaceToDepth", ["x"], ["y"], blocksize=2, mode=mode)
        model = _model(node, [info("x", TensorProto.FLOAT, [1, 2, 4, 6])], [info("y", TensorProto.FLOAT, None)], 28)
        x = np.arange(48, dtype=np.float32).reshape(1, 2, 4, 6)
        (got,), = _run(model, tmp_path, {}, [{"x": x}])
        np.testing.assert_array_equal(got, ReferenceEvaluator(model).run(None, {"x": x})[0])


def _resize_model(scales, dims, **attrs) -> onnx.ModelProto:
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], name="up", **attrs)
    return _model(node, [info("x", TensorProto.FLOAT, dims)], [info("y", TensorProto.FLOAT, None)],
                  18, [numpy_helper.from_array(np.array(scales, np.float32), "scales")])


def test_resize_by_a_scale_of_no_integer_product_is_refused(tmp_path):
    """TVM maps coordinates by ``in / out`` with ``out = floor(scale * dim)``, ONNX by the
    scale: [2, 3] by 1.5 (linear) was off by 0.21. Refused where the product is not an
    integer for every allowed dim (a symbolic dim by a non-integer scale too); integer
    products and align_corners (lengths only) equal onnxruntime."""
    _refused(_resize_model([1, 1, 1, 1.5], [1, 1, 2, 3], mode="linear"),
             "Resize node 'up'", "axis 3: scale 1.5 of dim 3", "half_pixel")
    _refused(_resize_model([1, 1, 0.5, 0.5], [1, 1, "h", "w"], mode="nearest"),
             "axis 2: scale 0.5 of dim h", dims={"h": (2, 8), "w": (2, 8)})
    _refused(_resize_model([1, 2, 1, 1], [1, 1, 2, 3]), "batch or channel axis")
    rng = np.random.default_rng(0)
    x = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    _equals_onnxruntime(_resize_model([1, 1, 0.5, 1.5], [1, 1, 4, 2], mode="linear"), tmp_path,
                        {}, [{"x": x(1, 1, 4, 2)}] * 2)
    _equals_onnxruntime(_resize_model([1, 1, 1, 1.5], [1, 1, 2, 3], mode="linear",
                                      coordinate_transformation_mode="align_corners"),
                        tmp_path, {}, [{"x": x(1, 1, 2, 3)}] * 2)
    _equals_onnxruntime(_resize_model([1, 1, 3, 1], [1, 1, "h", 2], mode="nearest"), tmp_path,
                        {"h": (1, 5)}, [{"x": x(1, 1, h, 2)} for h in (1, 3, 5, 1)])
