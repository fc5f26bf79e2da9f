"""Which ``if``s become selects (``IfToSelect``), and what a build does when a select fails.

A select computes both branches and picks with ``R.where``, which broadcasts: it is only
right when both branches have the ``if``'s shape. ONNX models whose branches differ in
shape (issue 13, items 2 and 10) against onnxruntime on both branches, the pass on tiny
IRModules, and the build's fallback when a rewrite of an ``if`` cannot be lowered.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from tvm.script import ir as I
from tvm.script import relax as R

import grape_tvm
from grape_tvm.passes import IfToSelect
from test_branches import ResultIsOutput, ShapeDependsOnBranch
from test_passes import _has_if

INFO = helper.make_tensor_value_info
NODE = helper.make_node


def _if_model(then_nodes, else_nodes, x_shape, inits=()) -> onnx.ModelProto:
    """``y = If(sum(x) > 0, then, else)``; the branches read ``x`` from the outer scope."""
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    then_g = helper.make_graph(then_nodes, "then", [], [INFO("t", TensorProto.FLOAT, None)])
    else_g = helper.make_graph(else_nodes, "else", [], [INFO("e", TensorProto.FLOAT, None)])
    nodes = [NODE("ReduceSum", ["x"], ["s"], keepdims=0), NODE("Greater", ["s", "zero"], ["c"]),
             NODE("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)]
    graph = helper.make_graph(nodes, "if_shapes", [INFO("x", TensorProto.FLOAT, list(x_shape))],
                              [INFO("y", TensorProto.FLOAT, None)], [zero, *inits])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def whole_or_first_row() -> onnx.ModelProto:
    """then: ``x`` (n, 8); else: ``x[0:1]`` (1, 8) (item 2)."""
    consts = [numpy_helper.from_array(np.array([v], np.int64), k)
              for k, v in (("starts", 0), ("ends", 1), ("axes", 0))]
    return _if_model([NODE("Identity", ["x"], ["t"])],
                     [NODE("Slice", ["x", "starts", "ends", "axes"], ["e"])], ["n", 8], consts)


def reshape_or_identity() -> onnx.ModelProto:
    """then: ``x`` reshaped to (-1, 16); else: ``x`` (n, m) (item 10: the select's
    ``R.where`` reached CodeGenVM unlowered)."""
    shape = numpy_helper.from_array(np.array([-1, 16], np.int64), "shape")
    return _if_model([NODE("Reshape", ["x", "shape"], ["t0"]), NODE("Relu", ["t0"], ["t"])],
                     [NODE("Neg", ["x"], ["e"])], ["n", "m"], [shape])


def _ort(model: onnx.ModelProto, tmp_path, inputs: dict) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, inputs)[0]


def _check_both_branches(model, dims, shapes, tmp_path, **build_kwargs):
    module = grape_tvm.compile_onnx(model, dims, "llvm", **build_kwargs)
    executor = grape_tvm.load(module.export(tmp_path / "m.grape"), "cpu")
    rng = np.random.default_rng(0)
    for shape in shapes:
        for sign in (1.0, -1.0):  # sum(x) > 0: then branch; < 0: else branch
            x = (sign * (np.abs(rng.standard_normal(shape)) + 0.1)).astype(np.float32)
            want = _ort(model, tmp_path, {"x": x})
            got = executor.run({"x": x})["y"]
            assert got.shape == want.shape, (shape, sign)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    return module


def test_branches_of_different_shapes_are_not_a_select(tmp_path, capsys):
    module = _check_both_branches(whole_or_first_row(), {"n": (1, 8)},
                                  [(n, 8) for n in (1, 3, 5, 8)], tmp_path)
    (note,) = module.plan["notes"]
    assert "not a select" in note and "shapes differ" in note
    from grape_tvm.cli import main  # pylint: disable=import-outside-toplevel

    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "m.grape")]) == 0
    assert f"note: {note}" in capsys.readouterr().out


def test_reshaped_branch_compiles_and_equals_onnxruntime(tmp_path):
    dims = {"n": (1, 8), "m": (1, 16)}
    shapes = [(2, 8), (4, 4), (3, 16), (1, 16)]
    _check_both_branches(reshape_or_identity(), dims, shapes, tmp_path)
    _check_both_branches(reshape_or_identity(), dims, shapes, tmp_path, select_ops=0)


# -- the rule, on tiny modules ------------------------------------------------------------

@I.ir_module
class _Broadcastable:
    """(n, 8) against (1, 8): ``R.where`` would broadcast them to (n, 8)."""

    @R.function
    def main(x: R.Tensor(("n", 8), "float32"), row: R.Tensor((1, 8), "float32"),
             cond: R.Tensor((), "bool")):
        if cond:
            r = R.nn.relu(x)
        else:
            r = R.negative(row)
        return r


def test_if_to_select_needs_one_shape_for_both_branches():
    assert _has_if(IfToSelect()(ShapeDependsOnBranch))  # (n, 16) or its first row
    assert _has_if(IfToSelect()(_Broadcastable))
    notes = dict(IfToSelect()(_Broadcastable)["main"].attrs["grape.if_notes"])
    assert "shapes differ" in notes["r"]
    selected = IfToSelect()(ResultIsOutput)  # relu or negative of (n, 16)
    assert not _has_if(selected)
    assert selected["main"].attrs is None or "grape.if_notes" not in selected["main"].attrs


# -- a rewrite that cannot be lowered: the build falls back and says so ------------------

def test_build_falls_back_when_a_select_cannot_be_lowered(tmp_path, monkeypatch):
    """With the shape rule switched off, the reshaped branch's select reaches CodeGenVM
    (``R.where`` of unknown shape): the build warns, keeps every ``if`` (no selects) and
    notes it in the plan; results still equal onnxruntime."""
    from grape_tvm.passes import if_to_select  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(if_to_select, "_shape_mismatch", lambda *args: "")
    dims = {"n": (1, 8), "m": (1, 16)}
    with pytest.warns(UserWarning, match="select"):
        module = _check_both_branches(reshape_or_identity(), dims, [(2, 8), (3, 16)], tmp_path)
    assert any("select_ops=0" in note for note in module.plan["notes"])
