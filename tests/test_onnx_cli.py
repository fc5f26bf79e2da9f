"""The command line end to end on ONNX models, against onnxruntime."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import onnxruntime_outputs
from grape_tvm.cli import main


def _compile(model, out, *dims, target="llvm") -> int:
    return main(["compile", str(model), "-o", str(out), "--target", target,
                 *[a for d in dims for a in ("--dim", d)]])


def _run(artifact, inputs: dict, tmp_path) -> dict:
    np.savez(tmp_path / "in.npz", **inputs)
    assert main(["run", str(artifact), "--inputs", str(tmp_path / "in.npz"),
                 "--outputs", str(tmp_path / "out.npz"), "--device", "cpu"]) == 0
    with np.load(tmp_path / "out.npz") as npz:
        return {k: npz[k] for k in npz.files}


@pytest.mark.parametrize("n", [1, 37, 96])  # lower bound, between, upper bound
def test_blocks_equal_onnxruntime_at_bounds_and_between(models, tmp_path, n):
    artifact = tmp_path / "blocks.grape"
    assert _compile(models["blocks"], artifact, "n=1:96") == 0
    x = np.random.default_rng(n).standard_normal((n, 64)).astype(np.float32)
    got = _run(artifact, {"x": x}, tmp_path)
    assert list(got) == ["y"]
    np.testing.assert_allclose(got["y"], onnxruntime_outputs(models["blocks"], {"x": x})[0],
                               rtol=1e-4, atol=1e-4)


def test_if_model_takes_both_branches_like_onnxruntime(models, tmp_path):
    import onnx  # pylint: disable=import-outside-toplevel
    from onnx import numpy_helper  # pylint: disable=import-outside-toplevel

    artifact = tmp_path / "if.grape"
    assert _compile(models["if"], artifact, "n=1:16") == 0
    w = numpy_helper.to_array(onnx.load(str(models["if"])).graph.initializer[0])
    rng = np.random.default_rng(0)
    branches = []
    for n in (1, 16, 7):
        u = rng.standard_normal((n, 8)).astype(np.float32)
        for x in (u, -u):  # sum(x @ w) changes sign: one call per branch
            branches.append(bool((x @ w).sum() > 0))
            got = _run(artifact, {"x": x}, tmp_path)["y"]
            np.testing.assert_allclose(got, onnxruntime_outputs(models["if"], {"x": x})[0],
                                       rtol=1e-4, atol=1e-4)
    assert set(branches) == {True, False}
    description = _inspect_json(artifact)  # cheap branches: selects, one graph region
    assert description["host_steps"] == [] and len(description["regions"]) == 1
    assert description["conditionals"] == []


def test_if_as_a_conditional_region_from_the_command_line(models, tmp_path, capsys):
    """``--select-ops 0``: the If becomes a conditional region; inspect says how it runs,
    the CLI's run equals onnxruntime on both signs of the input."""
    artifact = tmp_path / "if_cond.grape"
    assert main(["compile", str(models["if"]), "-o", str(artifact), "--dim", "n=1:16",
                 "--select-ops", "0"]) == 0
    assert "1 conditional region(s), 0 host step(s)" in capsys.readouterr().out
    description = _inspect_json(artifact)
    (conditional,) = description["conditionals"]
    assert conditional["then_calls"] and conditional["else_calls"]
    assert "by the CPU replay" in conditional["condition_read"]
    assert "not yet recorded" in conditional["host_read"]
    assert main(["inspect", str(artifact)]) == 0
    assert "conditional regions (data-dependent branches, no host read): 1" in capsys.readouterr().out
    u = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    for x in (u, -u):
        got = _run(artifact, {"x": x}, tmp_path)["y"]
        np.testing.assert_allclose(got, onnxruntime_outputs(models["if"], {"x": x})[0],
                                   rtol=1e-4, atol=1e-4)


def test_two_inputs_share_dims(models, tmp_path):
    artifact = tmp_path / "two.grape"
    assert _compile(models["two_inputs"], artifact, "b=1:4", "n=1:32") == 0
    rng = np.random.default_rng(0)
    for b, n in [(1, 1), (4, 32), (2, 9)]:
        inputs = {"x": rng.standard_normal((b, n, 8)).astype(np.float32),
                  "mask": (rng.random((b, n)) > 0.5).astype(np.float32)}
        got = _run(artifact, inputs, tmp_path)["y"]
        np.testing.assert_allclose(got, onnxruntime_outputs(models["two_inputs"], inputs)[0],
                                   rtol=1e-6, atol=1e-6)


def _inspect_json(artifact) -> dict:
    proc = subprocess.run([sys.executable, "-m", "grape_tvm.cli", "inspect", str(artifact), "--json"],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def test_inspect_reports_dims_io_regions_and_host_steps(models, tmp_path, capsys):
    artifact = tmp_path / "blocks.grape"
    assert _compile(models["blocks"], artifact, "n=2:50") == 0
    d = _inspect_json(artifact)
    assert {"dims", "inputs", "outputs", "regions", "host_steps"} <= set(d)
    assert d["dims"] == {"n": {"lo": 2, "hi": 50}}
    assert d["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["n", 64], "kind": "tensor"}]
    assert d["outputs"][0]["name"] == "y"
    assert len(d["regions"]) == 1 and d["regions"][0]["symbolic_vars"] == ["n"]
    assert len(d["regions"][0]["kernels"]) >= 2 and d["host_steps"] == []
    capsys.readouterr()
    assert main(["inspect", str(artifact)]) == 0
    text = capsys.readouterr().out
    assert "n = 2..50" in text and "grape_region_0" in text


def test_console_script_compiles(models, tmp_path):
    exe = Path(sys.executable).with_name("grape-tvm")
    if not exe.exists():
        exe = shutil.which("grape-tvm") or pytest.skip("the grape-tvm script is not installed")
    proc = subprocess.run([exe, "compile", str(models["blocks"]), "-o", str(tmp_path / "b.grape"),
                           "--dim", "n=1:8"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "1 graph region(s)" in proc.stdout


@pytest.mark.parametrize("args, message", [
    ([], "dimension 'n' of input 'x' (axis 0) has no declared range: pass --dim n=LO:HI"),
    (["--dim", "n=1-8"], "range of dimension 'n' must be LO:HI, two integers, got '1-8'"),
    (["--dim", "n=1:8", "--dim", "seq=1:8"], "declared dimension(s) ['seq'] are not dim_param names"),
    (["--dim", "n=9:8"], "needs 0 <= lo <= hi, got 9..8"),
    (["--dim", "n=1:8", "--target", "metal"], "unknown target 'metal'"),
])
def test_compile_errors_are_one_clear_line(models, tmp_path, capsys, args, message):
    code = main(["compile", str(models["blocks"]), "-o", str(tmp_path / "x.grape"), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err, err
    assert not (tmp_path / "x.grape").exists()


def test_run_error_names_the_input(models, tmp_path, capsys):
    artifact = tmp_path / "blocks.grape"
    assert _compile(models["blocks"], artifact, "n=1:8") == 0
    np.savez(tmp_path / "in.npz", x=np.zeros((9, 64), np.float32))
    code = main(["run", str(artifact), "--inputs", str(tmp_path / "in.npz"),
                 "--outputs", str(tmp_path / "out.npz")])
    assert code == 2
    assert "input 'x' axis 0 (dimension 'n') is 9, outside its declared range 1..8" in capsys.readouterr().err
    assert not (tmp_path / "out.npz").exists()


def test_inspect_record_shows_topology_groups_and_tables(models, tmp_path, capsys):
    artifact = tmp_path / "blocks.grape"
    assert _compile(models["blocks"], artifact, "n=1:20") == 0
    capsys.readouterr()
    assert main(["inspect", str(artifact), "--record", "--json"]) == 0
    graphs = json.loads(capsys.readouterr().out)["graphs"]
    groups = graphs["topology_groups"]["grape_region_0"]
    assert sum(g["shapes"] for g in groups) == 20
    assert all(g["table_bytes_compressed"] <= g["table_bytes_uncompressed"] or g["columns"] == 0
               for g in groups)


def _model(nodes, inputs, outputs, inits=()):
    from onnx import helper  # pylint: disable=import-outside-toplevel

    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_scalar_inputs_shape_outputs_and_data_dependent_sizes(tmp_path):
    """Found by the conformance run: a 0-d input, a Shape output (the VM returns a shape,
    not a tensor) and an output whose size depends on the data (Unique)."""
    import onnx  # pylint: disable=import-outside-toplevel
    from onnx import TensorProto, helper  # pylint: disable=import-outside-toplevel

    import grape_tvm  # pylint: disable=import-outside-toplevel

    info = helper.make_tensor_value_info
    cases = {
        "scalar": (_model([helper.make_node("Neg", ["x"], ["y"])],
                          [info("x", TensorProto.FLOAT, [])], [info("y", TensorProto.FLOAT, [])]),
                   {"x": np.array(2.5, np.float32)}),
        "shape": (_model([helper.make_node("Shape", ["x"], ["y"])],
                         [info("x", TensorProto.FLOAT, [2, 3, 4])], [info("y", TensorProto.INT64, [3])]),
                  {"x": np.zeros((2, 3, 4), np.float32)}),
        "unique": (_model([helper.make_node("Unique", ["x"], ["y"], sorted=1)],
                          [info("x", TensorProto.FLOAT, [6])], [info("y", TensorProto.FLOAT, [None])]),
                   {"x": np.array([3, 1, 3, 2, 1, 5], np.float32)}),
    }
    for name, (model, inputs) in cases.items():
        path = tmp_path / f"{name}.onnx"
        onnx.save(model, str(path))
        grape_tvm.compile_onnx(path, {}, "llvm").export(tmp_path / f"{name}.grape")
        got = grape_tvm.load(tmp_path / f"{name}.grape", "cpu").run(inputs)["y"]
        want = onnxruntime_outputs(path, inputs)[0]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want)


def test_constants_given_as_value_float_or_ints(tmp_path):
    """TVM's importer reads only Constant's ``value``; grape rewrites the typed forms."""
    import onnx  # pylint: disable=import-outside-toplevel
    from onnx import TensorProto, helper  # pylint: disable=import-outside-toplevel
    from tvm.relax.frontend.onnx import from_onnx  # pylint: disable=import-outside-toplevel

    import grape_tvm  # pylint: disable=import-outside-toplevel

    info = helper.make_tensor_value_info
    model = _model(
        [helper.make_node("Constant", [], ["a"], value_float=0.5),
         helper.make_node("Constant", [], ["shape"], value_ints=[3, 2]),
         helper.make_node("Mul", ["x", "a"], ["h"]),
         helper.make_node("Reshape", ["h", "shape"], ["y"])],
        [info("x", TensorProto.FLOAT, [2, 3])], [info("y", TensorProto.FLOAT, [3, 2])])
    with pytest.raises(Exception, match="no value in Constant"):
        from_onnx(model)  # TVM alone
    path = tmp_path / "const.onnx"
    onnx.save(model, str(path))
    grape_tvm.compile_onnx(path, {}).export(tmp_path / "const.grape")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = grape_tvm.load(tmp_path / "const.grape").run({"x": x})["y"]
    np.testing.assert_array_equal(got, onnxruntime_outputs(path, {"x": x})[0])


@pytest.mark.parametrize("dim", ["batch size", "batch-size", "s0 + 1"])
def test_dim_params_that_are_not_identifiers_keep_their_names(tmp_path, dim):
    """Exporters write dim_params such as "batch size"; TVM's importer reads one as an
    expression ("batch-size" is batch - size). Users see and type the model's own names."""
    import onnx  # pylint: disable=import-outside-toplevel
    from onnx import TensorProto, helper, numpy_helper  # pylint: disable=import-outside-toplevel

    info = helper.make_tensor_value_info
    model = _model([helper.make_node("MatMul", ["x", "w"], ["h"]),
                    helper.make_node("Relu", ["h"], ["r"]),
                    helper.make_node("MatMul", ["r", "w"], ["y"])],
                   [info("x", TensorProto.FLOAT, [dim, 4])], [info("y", TensorProto.FLOAT, [dim, 4])],
                   [numpy_helper.from_array(np.eye(4, dtype=np.float32) - 0.5, "w")])
    path, artifact = tmp_path / "m.onnx", tmp_path / "m.grape"
    onnx.save(model, str(path))
    assert _compile(path, artifact, f"{dim}=1:8") == 0
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    np.testing.assert_allclose(_run(artifact, {"x": x}, tmp_path)["y"],
                               onnxruntime_outputs(path, {"x": x})[0], rtol=1e-5, atol=1e-5)
    description = _inspect_json(artifact)
    assert description["dims"] == {dim: {"lo": 1, "hi": 8}}
    assert description["inputs"][0]["shape"] == [dim, 4]
    assert [r["symbolic_vars"] for r in description["regions"]] == [[dim]]


# The deploy host of pyproject.toml: the TVM runtime, numpy and cuda-bindings; neither onnx nor
# TVM's compiler (tvm.relax). A finder refuses to import them, then the CLI runs.
_WITHOUT_COMPILER = """
import importlib.abc, sys

class NoCompiler(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "onnx" or name.split(".")[:2] == ["tvm", "relax"]:
            raise ModuleNotFoundError(f"No module named {name!r} on this host", name=name)
        return None

sys.meta_path.insert(0, NoCompiler())
from grape_tvm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _deployed_cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}  # TVM without its compiler library
    return subprocess.run([sys.executable, "-c", _WITHOUT_COMPILER, *map(str, args)],
                          capture_output=True, text=True, env=env, check=False)


def test_run_and_inspect_need_neither_onnx_nor_tvm_compiler(models, tmp_path):
    from test_onnx_loop import _affine_inputs, affine_loop  # pylint: disable=import-outside-toplevel

    import onnx  # pylint: disable=import-outside-toplevel

    blocks = tmp_path / "blocks.grape"
    assert _compile(models["blocks"], blocks, "n=1:16") == 0
    onnx.save(affine_loop(), str(tmp_path / "loop.onnx"))
    assert _compile(tmp_path / "loop.onnx", tmp_path / "loop.grape", "n=1:16") == 0
    cases = {blocks: ({"x": np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)},
                      models["blocks"]),
             tmp_path / "loop.grape": (_affine_inputs(5, 100), tmp_path / "loop.onnx")}
    for artifact, (inputs, onnx_path) in cases.items():
        np.savez(tmp_path / "in.npz", **inputs)
        proc = _deployed_cli("run", artifact, "--inputs", tmp_path / "in.npz",
                             "--outputs", tmp_path / "out.npz")
        assert proc.returncode == 0, proc.stderr
        with np.load(tmp_path / "out.npz") as npz:
            for got, want in zip(npz.values(), onnxruntime_outputs(onnx_path, inputs)):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        proc = _deployed_cli("inspect", artifact, "--json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["inputs"]


def _matmul_with_weight_input(tmp_path) -> Path:
    """``y = x @ w + b`` (x: (n, 16), w: (16, 8)), w and b graph inputs (a weightless export),
    w named as exporters name weights ("fc.weight": not an identifier, which the importer
    renames)."""
    import onnx  # pylint: disable=import-outside-toplevel
    from onnx import TensorProto, helper  # pylint: disable=import-outside-toplevel

    info = helper.make_tensor_value_info
    model = _model([helper.make_node("MatMul", ["x", "fc.weight"], ["h"]),
                    helper.make_node("Add", ["h", "b"], ["y"])],
                   [info("x", TensorProto.FLOAT, ["n", 16]),
                    info("fc.weight", TensorProto.FLOAT, [16, 8]),
                    info("b", TensorProto.FLOAT, [8])],
                   [info("y", TensorProto.FLOAT, ["n", 8])])
    path = tmp_path / "linear.onnx"
    onnx.save(model, str(path))
    return path


def test_weights_from_the_command_line_are_transposed_as_bound(tmp_path, capsys):
    model = _matmul_with_weight_input(tmp_path)
    artifact = tmp_path / "linear.grape"
    assert main(["compile", str(model), "-o", str(artifact), "--dim", "n=1:32",
                 "--weights", "fc.weight,b"]) == 0
    assert _inspect_json(artifact)["transposed_inputs"] == ["fc.weight"]
    rng = np.random.default_rng(3)
    for n in (1, 5, 32):
        inputs = {"x": rng.standard_normal((n, 16)).astype(np.float32),
                  "fc.weight": rng.standard_normal((16, 8)).astype(np.float32),
                  "b": rng.standard_normal(8).astype(np.float32)}
        got = _run(artifact, inputs, tmp_path)  # the npz holds the weight as the model has it
        np.testing.assert_allclose(got["y"], onnxruntime_outputs(model, inputs)[0],
                                   rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    assert main(["inspect", str(artifact), "--record", "--json"]) == 0  # zeros bound for it
    code = main(["compile", str(model), "-o", str(tmp_path / "x.grape"), "--dim", "n=1:32",
                 "--weights", "fc.weight,v"])
    assert code == 2
    assert "weights names ['v'], which the model does not take" in capsys.readouterr().err
    assert not (tmp_path / "x.grape").exists()
