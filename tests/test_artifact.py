"""Tests of the ``.grape`` artifact format and of loading an artifact on the wrong device."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import grape_tvm
from grape_tvm.artifact import FORMAT_VERSION, MAGIC, Artifact, ArtifactError

D = 8
_HEADER = struct.Struct("<8sIQ")  # magic, format version, manifest length (the documented layout)


def _weights() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((D, D)).astype("float32")


def tiny_onnx() -> onnx.ModelProto:
    """y = relu(x @ W) over x of shape (n, 8)."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    graph = helper.make_graph(
        nodes, "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", D])],
        [numpy_helper.from_array(_weights(), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def sample() -> Artifact:
    x = {"name": "x", "dtype": "float32", "shape": ["n", 8]}
    manifest = {"target": {"kind": "llvm"},
                "signature": {"inputs": [x], "outputs": [{**x, "name": "y"}], "dims": {"n": [1, 8]}},
                "plan": {"regions": [{"name": "grape_region_0", "kernels": ["k0", "k1"],
                                      "symbolic_vars": ["n"]}], "host_steps": []},
                "note": "unicode ok: \u00e9\u4e2d"}
    sections = {"library": bytes(range(256)) * 40, "cubin/abc123": b"\x7fELF" + b"\x00" * 300,
                "empty": b""}
    return Artifact(manifest, sections)


@pytest.fixture
def saved(tmp_path):
    return sample().save(tmp_path / "model.grape")


def reseal(data: bytes) -> bytes:
    """Recompute the trailing sha256 so that only the edit made to ``data`` is wrong."""
    body = data[:-32]
    return body + hashlib.sha256(body).digest()


# -- round trip ---------------------------------------------------------------------------

def test_round_trip_keeps_manifest_and_sections(saved):
    original = sample()
    loaded = Artifact.load(saved)
    assert loaded.sections == original.sections
    assert list(loaded.sections) == list(original.sections)  # order kept
    index = loaded.manifest.pop("sections")
    assert loaded.manifest == original.manifest
    assert [(e["name"], e["size"]) for e in index] == [(k, len(v)) for k, v in original.sections.items()]
    for entry in index:
        assert entry["sha256"] == hashlib.sha256(original.sections[entry["name"]]).hexdigest()


def test_saved_file_has_the_documented_layout(saved):
    data = saved.read_bytes()
    magic, version, manifest_len = _HEADER.unpack_from(data)
    assert magic == MAGIC == b"GRAPETVM"
    assert version == FORMAT_VERSION == 1
    manifest = json.loads(data[_HEADER.size:_HEADER.size + manifest_len])
    assert manifest["target"] == {"kind": "llvm"}
    payload = _HEADER.size + manifest_len
    assert data[payload:-32] == b"".join(sample().sections.values())
    assert data[-32:] == hashlib.sha256(data[:-32]).digest()
    assert sample().sha256 == hashlib.sha256(data).hexdigest()
    assert not saved.with_name(saved.name + ".tmp").exists()


def test_reserialized_artifact_is_byte_identical(saved):
    data = saved.read_bytes()
    assert Artifact.from_bytes(data).to_bytes() == data
    assert Artifact.load(saved).sha256 == hashlib.sha256(data).hexdigest()


# -- damaged or foreign files --------------------------------------------------------------

def test_truncated_file_is_an_error_naming_it(saved):
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError) as err:
        Artifact.load(saved)
    msg = str(err.value)
    assert str(saved) in msg
    assert "damaged" in msg and "checksum" in msg
    assert f"{len(data) // 2} bytes" in msg


def test_file_truncated_inside_its_header_says_truncated(saved):
    saved.write_bytes(saved.read_bytes()[:30])
    with pytest.raises(ArtifactError) as err:
        Artifact.load(saved)
    msg = str(err.value)
    assert str(saved) in msg
    assert "no GRAPETVM header" not in msg
    assert "truncated" in msg or "damaged" in msg


def test_one_flipped_byte_is_an_error_naming_the_file(saved):
    data = bytearray(saved.read_bytes())
    data[len(data) // 2] ^= 0x01
    saved.write_bytes(bytes(data))
    with pytest.raises(ArtifactError) as err:
        Artifact.load(saved)
    msg = str(err.value)
    assert str(saved) in msg
    assert "damaged" in msg and "sha256 checksum does not match" in msg


def test_flipped_byte_in_manifest_is_caught_too(saved):
    data = bytearray(saved.read_bytes())
    data[_HEADER.size + 3] ^= 0x20
    saved.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum"):
        Artifact.load(saved)


def test_other_format_version_is_an_error_naming_both_versions(saved):
    data = bytearray(saved.read_bytes())
    struct.pack_into("<I", data, 8, FORMAT_VERSION + 1)
    saved.write_bytes(reseal(bytes(data)))  # checksum valid again: only the version is wrong
    with pytest.raises(ArtifactError) as err:
        Artifact.load(saved)
    msg = str(err.value)
    assert str(saved) in msg
    assert f"format version {FORMAT_VERSION + 1}" in msg
    assert f"reads version {FORMAT_VERSION}" in msg
    assert "checksum" not in msg


def test_unreadable_manifest_with_valid_checksum(tmp_path):
    manifest = b"{not json"
    body = _HEADER.pack(MAGIC, FORMAT_VERSION, len(manifest)) + manifest
    path = tmp_path / "bad-manifest.grape"
    path.write_bytes(body + hashlib.sha256(body).digest())
    with pytest.raises(ArtifactError) as err:
        Artifact.load(path)
    assert str(path) in str(err.value)
    assert "unreadable manifest" in str(err.value)


def test_onnx_file_is_not_an_artifact(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(tiny_onnx(), str(path))
    with pytest.raises(ArtifactError) as err:
        Artifact.load(path)
    assert str(path) in str(err.value)
    assert "not a grape-tvm artifact" in str(err.value)


@pytest.mark.parametrize("content", [b"", b"hello, this is a text file\n" * 10])
def test_text_or_empty_file_is_not_an_artifact(tmp_path, content):
    path = tmp_path / "notes.txt"
    path.write_bytes(content)
    with pytest.raises(ArtifactError) as err:
        Artifact.load(path)
    assert str(path) in str(err.value)
    assert "not a grape-tvm artifact" in str(err.value)


def test_missing_path_is_an_error_naming_it(tmp_path):
    path = tmp_path / "nowhere" / "model.grape"
    with pytest.raises(ArtifactError) as err:
        Artifact.load(path)
    assert str(path) in str(err.value)
    assert "no such artifact file" in str(err.value)


def test_from_bytes_names_the_given_name():
    with pytest.raises(ArtifactError, match="^blob.bin is not a grape-tvm artifact"):
        Artifact.from_bytes(b"PK\x03\x04" + b"\x00" * 100, "blob.bin")



# -- a checksum-valid artifact whose manifest was crafted ----------------------------------

def craft(path, edit) -> None:
    """Apply ``edit`` to ``path``'s manifest (its sections index included) and reseal the
    file: the checksum is valid, only the manifest is wrong."""
    data = path.read_bytes()
    _, version, length = _HEADER.unpack_from(data)
    manifest = json.loads(data[_HEADER.size:_HEADER.size + length])
    edit(manifest)
    text = json.dumps(manifest).encode()
    body = _HEADER.pack(MAGIC, version, len(text)) + text + data[_HEADER.size + length:-32]
    path.write_bytes(body + hashlib.sha256(body).digest())


def _put(*keys_and_value):
    *keys, value = keys_and_value

    def edit(manifest):
        for key in keys[:-1]:
            manifest = manifest[key]
        manifest[keys[-1]] = value
    return edit


def _drop(*keys):
    def edit(manifest):
        for key in keys[:-1]:
            manifest = manifest[key]
        del manifest[keys[-1]]
    return edit


CRAFTED = [
    (_drop("signature"), "field 'signature' is missing"),
    (_drop("signature", "outputs", 0, "dtype"), "field 'signature.outputs[0].dtype' is missing"),
    (_put("target", "llvm"), "field 'target' is \"llvm\", expected an object"),
    (_put("target", "kind", "metal"), "field 'target.kind' is \"metal\", expected one of"),
    (_put("sections", []), "has no 'library' section"),
    (_put("sections", 0, "offset", 10**9), "section 'library' (sections[0]) lies outside"),
    (_put("signature", "dims", []), "field 'signature.dims' is [], expected an object"),
    (_put("signature", "dims", "n", [9, 1]), "field 'signature.dims.n' is [9, 1], expected"),
    (_put("signature", "inputs", 0, "shape", "n"),
     "field 'signature.inputs[0].shape' is \"n\", expected a list"),
    (_put("plan", "regions", None), "field 'plan.regions' is null, expected a list"),
    (_put("plan", "branches", {"grape_cond_0": []}),
     "field 'plan.branches.grape_cond_0' is [], expected an object"),
    (_put("loop", []), "field 'loop' is [], expected an object"),
]


@pytest.mark.parametrize("edit, message", CRAFTED)
def test_crafted_manifest_is_an_error_naming_the_field(llvm_artifact, tmp_path, edit, message):
    path = tmp_path / "crafted.grape"
    path.write_bytes(llvm_artifact.read_bytes())
    craft(path, edit)
    with pytest.raises(ArtifactError) as err:
        Artifact.load(path)
    assert str(err.value).startswith(f"{path} has a malformed manifest: "), err.value
    assert message in str(err.value)


# -- a real artifact, loaded on the wrong device -----------------------------------------

@pytest.fixture(scope="module")
def llvm_artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("llvm") / "tiny.grape"
    grape_tvm.compile_onnx(tiny_onnx(), dims={"n": (1, 8)}, target="llvm").export(path)
    return path


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPE_TVM_CACHE", str(tmp_path / "cache"))


def test_llvm_artifact_runs_on_cpu(llvm_artifact):
    manifest = Artifact.load(llvm_artifact).manifest
    assert manifest["target"] == {"kind": "llvm"}
    assert manifest["signature"]["dims"] == {"n": [1, 8]}
    ex = grape_tvm.load(llvm_artifact, device="cpu")
    x = np.random.default_rng(1).standard_normal((5, D)).astype("float32")
    out = ex.run({"x": x})
    np.testing.assert_allclose(out["y"], np.maximum(x @ _weights(), 0), rtol=1e-5, atol=1e-5)


def test_llvm_artifact_on_cuda_is_a_clear_error(llvm_artifact):
    with pytest.raises(ArtifactError) as err:
        grape_tvm.load(llvm_artifact, device="cuda")
    msg = str(err.value)
    assert str(llvm_artifact) in msg
    assert "compiled for llvm" in msg
    assert "not on 'cuda'" in msg
    assert "--target cuda" in msg


def test_cuda_artifact_on_cpu_is_a_clear_error(tmp_path):
    # Building for CUDA needs no GPU; prebuild_cubin=False keeps nvcc out of the test.
    path = tmp_path / "tiny.cuda.grape"
    grape_tvm.compile_onnx(tiny_onnx(), dims={"n": (1, 8)}, target="cuda",
                           prebuild_cubin=False).export(path)
    with pytest.raises(ArtifactError) as err:
        grape_tvm.load(path, device="cpu")
    msg = str(err.value)
    assert str(path) in msg
    assert "compiled for cuda" in msg
    assert "not on 'cpu'" in msg
    assert "--target llvm" in msg
