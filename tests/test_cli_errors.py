"""Bad input on the command line: each gets exit code 2 and one line naming the input and
what was expected; no traceback, nothing written, nothing left behind."""

from __future__ import annotations

import ctypes

import numpy as np
import onnx
import pytest

import grape_tvm
from grape_tvm.cli import main
from test_artifact import _drop, _put, craft, tiny_onnx


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """y = relu(x @ W), x: (n, 8) with n in 1..8, for the CPU."""
    path = tmp_path_factory.mktemp("cli") / "tiny.grape"
    grape_tvm.compile_onnx(tiny_onnx(), dims={"n": (1, 8)}, target="llvm").export(path)
    return path


def _listing(root) -> dict:
    """Every file and folder below ``root``, a file with its content."""
    return {p.relative_to(root): p.read_bytes() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


def refused(capsys, tmp_path, *argv) -> str:
    """Run the CLI on arguments it must refuse: exit code 2, one error line on stderr (after
    compile's progress line), nothing in ``tmp_path`` written or changed; the line."""
    before = _listing(tmp_path)
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("compiling ")]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"grape-tvm {argv[0]}: error: "), err
    assert _listing(tmp_path) == before
    return lines[0]


@pytest.mark.parametrize("edit, message", [
    (_drop("plan"), "field 'plan' is missing"),
    (_put("sections", []), "has no 'library' section"),
    (_put("signature", "dims", []), "field 'signature.dims' is [], expected an object"),
])
@pytest.mark.parametrize("command", ["run", "inspect"])
def test_crafted_manifest(artifact, tmp_path, capsys, edit, message, command):
    crafted = tmp_path / "crafted.grape"
    crafted.write_bytes(artifact.read_bytes())
    craft(crafted, edit)
    np.savez(tmp_path / "in.npz", x=np.ones((2, 8), np.float32))
    args = ["--inputs", tmp_path / "in.npz", "--outputs", tmp_path / "out.npz"] \
        if command == "run" else []
    line = refused(capsys, tmp_path, command, crafted, *args)
    assert f"{crafted} has a malformed manifest: " in line and message in line


@pytest.fixture(scope="module")
def cuda_artifact(tmp_path_factory):
    """The same model built for CUDA: building needs no GPU (nor nvcc without prebuilt cubins)."""
    path = tmp_path_factory.mktemp("cli") / "tiny.cuda.grape"
    grape_tvm.compile_onnx(tiny_onnx(), dims={"n": (1, 8)}, target="cuda",
                           prebuild_cubin=False).export(path)
    return path


@pytest.fixture(scope="module")
def onnx_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "tiny.onnx"
    onnx.save(tiny_onnx(), str(path))
    return path


def _has_cuda_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_has_cuda_driver(), reason="this host has a CUDA driver")
def test_run_on_cuda_without_a_driver(cuda_artifact, tmp_path, capsys):
    np.savez(tmp_path / "in.npz", x=np.ones((2, 8), np.float32))
    line = refused(capsys, tmp_path, "run", cuda_artifact, "--inputs", tmp_path / "in.npz",
                   "--outputs", tmp_path / "out.npz", "--device", "cuda")
    assert f"{cuda_artifact} runs on a CUDA GPU, and no CUDA driver is available here" in line


def test_compile_into_an_existing_folder(onnx_model, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    line = refused(capsys, tmp_path, "compile", onnx_model, "-o", tmp_path / "out",
                   "--dim", "n=1:8")
    assert f"-o {tmp_path / 'out'} is a folder, expected a file name" in line


def test_compile_into_a_missing_folder(onnx_model, tmp_path, capsys):
    line = refused(capsys, tmp_path, "compile", onnx_model, "-o", tmp_path / "no" / "m.grape",
                   "--dim", "n=1:8")
    assert f"-o {tmp_path / 'no' / 'm.grape'}: folder {tmp_path / 'no'} does not exist" in line


def _write_inputs(tmp_path, kind: str, artifact):
    """An --inputs path of the given kind: none of them an .npz file of numeric arrays."""
    x = np.ones((2, 8), np.float32)
    path = tmp_path / {"folder": "in", "npy": "x.npy", "artifact": "model.grape",
                       "big-endian": "in.npz", "objects": "in.npz"}[kind]
    if kind == "folder":
        path.mkdir()
    elif kind == "npy":
        np.save(path, x)
    elif kind == "artifact":
        path.write_bytes(artifact.read_bytes())
    elif kind == "big-endian":
        np.savez(path, x=x.astype(">f4"))
    else:
        np.savez(path, x=np.array([[1.0] * 8, ["a"] * 8], dtype=object))
    return path


@pytest.mark.parametrize("kind, message", [
    ("folder", "--inputs {path} is a folder, expected an .npz file"),
    ("npy", "--inputs {path} is not an .npz file (np.savez"),
    ("artifact", "--inputs {path} is not an .npz file (np.savez"),
    ("big-endian", "input 'x' is big-endian (>f4), expected the host's byte order"),
    ("objects", "input 'x' in {path} is not an array of numbers"),
])
def test_run_inputs_that_are_not_numeric_npz(artifact, tmp_path, capsys, kind, message):
    path = _write_inputs(tmp_path, kind, artifact)
    line = refused(capsys, tmp_path, "run", artifact, "--inputs", path,
                   "--outputs", tmp_path / "out.npz")
    assert message.format(path=path) in line


def test_run_writes_exactly_the_outputs_path_given(artifact, tmp_path, capsys):
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    assert main(["run", str(artifact), "--inputs", str(tmp_path / "in.npz"),
                 "--outputs", str(tmp_path / "out.txt")]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'out.txt'}: y(3, 8)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.npz", "out.txt"]
    with np.load(tmp_path / "out.txt") as npz:
        assert npz.files == ["y"] and npz["y"].shape == (3, 8)


def test_failed_run_keeps_an_existing_outputs_file(artifact, tmp_path, capsys):
    (tmp_path / "out.npz").write_bytes(b"results of an earlier run")
    np.savez(tmp_path / "in.npz", x=np.ones((9, 8), np.float32))  # n = 9 is outside 1..8
    line = refused(capsys, tmp_path, "run", artifact, "--inputs", tmp_path / "in.npz",
                   "--outputs", tmp_path / "out.npz")
    assert "input 'x' axis 0 (dimension 'n') is 9, outside its declared range 1..8" in line


def test_run_into_a_folder(artifact, tmp_path, capsys):
    np.savez(tmp_path / "in.npz", x=np.ones((2, 8), np.float32))
    (tmp_path / "out").mkdir()
    line = refused(capsys, tmp_path, "run", artifact, "--inputs", tmp_path / "in.npz",
                   "--outputs", tmp_path / "out")
    assert f"--outputs {tmp_path / 'out'} is a folder, expected a file name" in line


def _saved(tmp_path, model: onnx.ModelProto):
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    return path


def test_compile_an_empty_file(tmp_path, capsys):
    (tmp_path / "empty.onnx").write_bytes(b"")
    line = refused(capsys, tmp_path, "compile", tmp_path / "empty.onnx", "-o", tmp_path / "m.grape")
    assert f"{tmp_path / 'empty.onnx'} is empty, not an ONNX model" in line


def test_compile_a_model_with_an_unranked_input(tmp_path, capsys):
    model = tiny_onnx()
    model.graph.input[0].type.tensor_type.ClearField("shape")
    line = refused(capsys, tmp_path, "compile", _saved(tmp_path, model), "-o", tmp_path / "m.grape")
    assert "ONNX input 'x' has no shape (its rank is unknown)" in line


def test_compile_a_model_of_a_newer_opset(tmp_path, capsys):
    newest = onnx.defs.onnx_opset_version()
    model = tiny_onnx()
    model.opset_import[0].version = newest + 1
    path = _saved(tmp_path, model)
    line = refused(capsys, tmp_path, "compile", path, "--dim", "n=1:8", "-o", tmp_path / "m.grape")
    assert f"{path} uses ONNX opset {newest + 1} (domain ai.onnx); the installed onnx " \
           f"{onnx.__version__} knows opsets up to {newest}" in line


@pytest.mark.parametrize("dims, message", [
    (["n=1:1e23"], "range of dimension 'n' must be LO:HI, two integers, got '1:1e23'"),
    (["n=1:" + "1" + "0" * 23], "range of dimension 'n': a shape range's upper bound must be "
                                "at most 2**63 - 1 (TVM's shape values are int64), got 1" + "0" * 23),
    (["n=1:8", "n=1:16"], "--dim n is given twice (1:8 and 1:16)"),
])
def test_compile_dims_refused(onnx_model, tmp_path, capsys, dims, message):
    line = refused(capsys, tmp_path, "compile", onnx_model, "-o", tmp_path / "m.grape",
                   *[a for d in dims for a in ("--dim", d)])
    assert message in line


def test_compile_a_range_whose_planned_memory_exceeds_the_limit(models, tmp_path, capsys):
    line = refused(capsys, tmp_path, "compile", models["blocks"], "-o", tmp_path / "m.grape",
                   "--dim", "n=1:1000000", "--max-memory", "0.01")
    assert "memory planned at the declared upper bound n=1000000 is 512000000 bytes (488.3 MiB), " \
           "above the limit of 10737418 bytes (10.2 MiB)" in line


def test_compile_lists_every_unsupported_operator_with_its_nodes(tmp_path, capsys):
    """All of them at once, each with its count and nodes (TVM names each once)."""
    info = onnx.helper.make_tensor_value_info
    nodes = [onnx.helper.make_node("DFT", ["x"], ["a"]), onnx.helper.make_node("DFT", ["a"], ["b"]),
             onnx.helper.make_node("Det", ["b"], ["c"], name="det0"),
             onnx.helper.make_node("Relu", ["c"], ["y"])]
    graph = onnx.helper.make_graph(nodes, "m", [info("x", onnx.TensorProto.FLOAT, [2, 4, 2])],
                                   [info("y", onnx.TensorProto.FLOAT, None)])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 20)])
    model.ir_version = 10
    line = refused(capsys, tmp_path, "compile", _saved(tmp_path, model), "-o", tmp_path / "m.grape")
    assert ("2 operators: DFT (2 nodes: '<output a>', '<output b>'); Det (1 node: 'det0')"
            in line), line
