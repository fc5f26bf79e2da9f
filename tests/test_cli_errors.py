"""Bad input on the command line: each gets exit code 2 and one line naming the input and
what was expected; no traceback, nothing written, nothing left behind."""

from __future__ import annotations

import numpy as np
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
