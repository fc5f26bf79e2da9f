"""Bad input on the command line: each gets exit code 2 and one line naming the input and
what was expected; no traceback, nothing written, nothing left behind."""

from __future__ import annotations

import ctypes
from pathlib import Path

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


def _two_outputs_onnx(tmp_path, names):
    """relu(x) and -x over x of shape (n, 8), under the output names given."""
    info = onnx.helper.make_tensor_value_info
    nodes = [onnx.helper.make_node("Relu", ["x"], [names[0]]),
             onnx.helper.make_node("Neg", ["x"], [names[1]])]
    graph = onnx.helper.make_graph(nodes, "m", [info("x", onnx.TensorProto.FLOAT, ["n", 8])],
                                   [info(name, onnx.TensorProto.FLOAT, ["n", 8]) for name in names])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    return _saved(tmp_path, model)


def test_run_writes_outputs_named_as_np_savez_arguments(tmp_path, capsys):
    """Outputs named ``file`` and ``allow_pickle`` (np.savez's own arguments: the one
    failed the run, the other was dropped from the file) are written like any other."""
    artifact = tmp_path / "m.grape"
    assert main(["compile", str(_two_outputs_onnx(tmp_path, ["file", "allow_pickle"])),
                 "-o", str(artifact), "--dim", "n=1:8"]) == 0
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    assert main(["run", str(artifact), "--inputs", str(tmp_path / "in.npz"),
                 "--outputs", str(tmp_path / "out.npz")]) == 0, capsys.readouterr().err
    with np.load(tmp_path / "out.npz") as npz:
        assert npz.files == ["file", "allow_pickle"]
        np.testing.assert_array_equal(npz["file"], np.maximum(x, 0))
        np.testing.assert_array_equal(npz["allow_pickle"], -x)


def test_an_output_path_that_is_an_input_is_refused(artifact, onnx_model, tmp_path, capsys):
    """Writing it would destroy the input: the model compiled, the artifact run, or the
    inputs read."""
    model = tmp_path / "model.onnx"
    model.write_bytes(onnx_model.read_bytes())
    line = refused(capsys, tmp_path, "compile", model, "-o", model, "--dim", "n=1:8")
    assert f"-o {model} is also an input of this command" in line
    mine = tmp_path / "m.grape"
    mine.write_bytes(artifact.read_bytes())
    np.savez(tmp_path / "in.npz", x=np.ones((2, 8), np.float32))
    for outputs in (mine, tmp_path / "in.npz"):
        line = refused(capsys, tmp_path, "run", mine, "--inputs", tmp_path / "in.npz",
                       "--outputs", outputs)
        assert f"--outputs {outputs} is also an input of this command" in line


def test_run_into_a_pipe_writes_it_and_leaves_it_a_pipe(artifact, tmp_path, capsys):
    """A device or a pipe given as the outputs (/dev/null, a FIFO) is written to, not
    replaced by a regular file."""
    import os  # pylint: disable=import-outside-toplevel
    import stat  # pylint: disable=import-outside-toplevel

    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, so the write opens
    try:
        x = np.ones((2, 8), np.float32)
        np.savez(tmp_path / "in.npz", x=x)
        assert main(["run", str(artifact), "--inputs", str(tmp_path / "in.npz"),
                     "--outputs", str(fifo)]) == 0, capsys.readouterr().err
        assert stat.S_ISFIFO(os.stat(fifo).st_mode)
        written = os.read(reader, 1 << 16)
    finally:
        os.close(reader)
    (tmp_path / "read.npz").write_bytes(written)
    with np.load(tmp_path / "read.npz") as npz:
        assert npz.files == ["y"] and npz["y"].shape == (2, 8)


@pytest.mark.parametrize("argv, message", [
    (["--max-memory", "inf"], "--max-memory takes a positive number of GiB, got inf"),
    (["--max-memory", "nan"], "--max-memory takes a positive number of GiB, got nan"),
    (["--max-memory", "-1"], "--max-memory takes a positive number of GiB, got -1.0"),
    (["-o", "new/"], "-o new/ is a folder, expected a file name"),
    (["--select-ops", "-5"], "--select-ops takes a number of operators, 0 or more, got -5"),
])
def test_compile_options_refused_before_any_work(onnx_model, tmp_path, capsys, monkeypatch,
                                                 argv, message):
    monkeypatch.chdir(tmp_path)
    if "-o" not in argv:
        argv = [*argv, "-o", "m.grape"]
    line = refused(capsys, tmp_path, "compile", onnx_model, "--dim", "n=1:8", *argv)
    assert message in line


def test_compile_refuses_inputs_sharing_a_name(tmp_path, capsys):
    """ONNX's checker refuses such a model; the import took it, and its artifact failed
    with a traceback at its first call."""
    info = onnx.helper.make_tensor_value_info
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Add", ["x", "x"], ["y"])], "m",
        [info("x", onnx.TensorProto.FLOAT, ["n", 8]), info("x", onnx.TensorProto.FLOAT, ["n", 8])],
        [info("y", onnx.TensorProto.FLOAT, ["n", 8])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    line = refused(capsys, tmp_path, "compile", _saved(tmp_path, model), "-o",
                   tmp_path / "m.grape", "--dim", "n=1:8")
    assert "input name(s) ['x'] are given to more than one input" in line


def test_run_inputs_damaged_or_on_a_device_not_known(artifact, tmp_path, capsys):
    import io  # pylint: disable=import-outside-toplevel

    buffer = io.BytesIO()
    np.savez_compressed(buffer, x=np.arange(2 * 8, dtype=np.float32).reshape(2, 8))
    damaged = bytearray(buffer.getvalue())
    start = damaged.index(b"x.npy") + len(b"x.npy") + 40  # inside the deflated member
    damaged[start:start + 8] = b"\xff" * 8
    (tmp_path / "in.npz").write_bytes(bytes(damaged))
    line = refused(capsys, tmp_path, "run", artifact, "--inputs", tmp_path / "in.npz",
                   "--outputs", tmp_path / "out.npz")
    assert f"input 'x' in {tmp_path / 'in.npz'} is damaged" in line
    np.savez(tmp_path / "in.npz", x=np.ones((2, 8), np.float32))
    line = refused(capsys, tmp_path, "run", artifact, "--inputs", tmp_path / "in.npz",
                   "--outputs", tmp_path / "out.npz", "--device", "cuda:x")
    assert "device must be cpu or cuda[:N], got 'cuda:x'" in line


def test_record_all_refuses_more_shapes_than_the_executor_keeps(artifact):
    """Recording them would give the first up before the last is recorded (and listing
    the shapes of two wide ranges took all memory before anything showed)."""
    from grape_tvm.runtime import InputError  # pylint: disable=import-outside-toplevel

    executor = grape_tvm.load(artifact, max_shapes=4)
    try:
        with pytest.raises(InputError, match=r"record_all: the ranges n=1..8 are 8 "
                                                       r"shapes, more than this executor keeps "
                                                       r"\(max_shapes=4\)"):
            executor.record_all(progress=False)
        executor.record_all({"n": [2, 5]}, progress=False)
        assert sorted(executor.recorded_shapes.values())[0] == [(2,), (5,)]
    finally:
        executor.close()


def test_run_with_a_cache_that_cannot_be_written(artifact, tmp_path, capsys, monkeypatch):
    """The library is loaded from grape-tvm's cache: a cache path that is a file names the
    cache and the variable that moves it."""
    (tmp_path / "cache").write_bytes(b"not a folder")
    monkeypatch.setenv("GRAPE_TVM_CACHE", str(tmp_path / "cache"))
    np.savez(tmp_path / "in.npz", x=np.ones((2, 8), np.float32))
    line = refused(capsys, tmp_path, "run", artifact, "--inputs", tmp_path / "in.npz",
                   "--outputs", tmp_path / "out.npz")
    assert f"grape-tvm's cache {tmp_path / 'cache'} cannot hold the artifact's library" in line
    assert "set GRAPE_TVM_CACHE to a writable folder" in line


@pytest.mark.parametrize("command, message", [
    ("compile", "{path} is a folder, expected an ONNX file"),
    ("run", "{path} is a folder, expected an artifact file"),
    ("inspect", "{path} is a folder, expected an artifact file"),
])
def test_a_folder_given_as_the_model(tmp_path, capsys, command, message):
    (tmp_path / "model").mkdir()
    np.savez(tmp_path / "in.npz", x=np.ones((2, 8), np.float32))
    args = {"compile": ["-o", tmp_path / "m.grape", "--dim", "n=1:8"],
            "run": ["--inputs", tmp_path / "in.npz", "--outputs", tmp_path / "out.npz"],
            "inspect": []}[command]
    line = refused(capsys, tmp_path, command, tmp_path / "model", *args)
    assert message.format(path=tmp_path / "model") in line


def test_an_output_folder_or_device_not_writable(artifact, tmp_path, capsys, monkeypatch):
    """Checked before any work, as the system answers for the user running it (os.access;
    denied here to a user who is not root): the folder a file is written in (then renamed),
    or the device or pipe itself (written to: /dev/null needs no writable /dev)."""
    import os  # pylint: disable=import-outside-toplevel

    from grape_tvm import cli  # pylint: disable=import-outside-toplevel

    np.savez(tmp_path / "in.npz", x=np.ones((2, 8), np.float32))
    (tmp_path / "locked").mkdir()
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    denied = {tmp_path / "locked", fifo}
    real_access = os.access
    monkeypatch.setattr(cli.os, "access", lambda path, mode: Path(path) not in denied
                        and real_access(path, mode))
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a write to the pipe never blocks
    try:
        line = refused(capsys, tmp_path, "run", artifact, "--inputs", tmp_path / "in.npz",
                       "--outputs", tmp_path / "locked" / "out.npz")
        assert f"folder {tmp_path / 'locked'} is not writable" in line
        line = refused(capsys, tmp_path, "run", artifact, "--inputs", tmp_path / "in.npz",
                       "--outputs", fifo)
        assert f"--outputs {fifo} is not writable" in line
        denied = {tmp_path}  # the pipe's folder only: the pipe is written
        assert main(["run", str(artifact), "--inputs", str(tmp_path / "in.npz"),
                     "--outputs", str(fifo)]) == 0, capsys.readouterr().err
    finally:
        os.close(reader)
