"""The ``.grape`` artifact: one file, versioned and checksummed.

Layout (little endian)::

    b"GRAPETVM"            8 bytes magic
    format version         u32
    manifest length        u64
    manifest               UTF-8 JSON: signature, target, graph plan, sections
    sections               the compiled library (.so), any cubins and, in a tensor-parallel
                           artifact compiled from ONNX, its whole weights (``weight/NAME``,
                           .npy), back to back
    sha256                 32 bytes, over everything before it

Reading checks the manifest's fields before anything uses them: an edited or foreign one
fails with ``ArtifactError`` naming the field. Reading needs only the TVM runtime: nothing
here imports the compiler.
"""

from __future__ import annotations

import hashlib
import io
import json
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from grape_tvm.runtime.libraries import LIBRARY_PREFIXES

MAGIC = b"GRAPETVM"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIQ")
_DIGEST = 32


class ArtifactError(ValueError):
    """The file is not a loadable grape artifact; the message says why."""


def write_atomically(path: str | Path, write: Callable[[BinaryIO], object]) -> Path:
    """Write ``path`` through ``write(file)`` on a temporary file beside it, renamed over it
    once complete: a failed write leaves neither a half-written ``path`` nor the temporary.
    A device or a pipe at ``path`` (/dev/null) is written to, not replaced."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder, expected a file name")
    if path.exists() and not path.is_file():  # a device or a pipe (/dev/null): written to
        with open(path, "wb") as file:
            write(file)
        return path
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")  # unique: writers may race
    try:
        file = open(tmp, "wb")  # pylint: disable=consider-using-with
    except OSError as err:  # named as the caller knows it, not as the temporary
        raise type(err)(err.errno, f"{path} cannot be written: {err.strerror}") from None
    try:
        with file:
            write(file)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


@dataclass
class Artifact:
    manifest: dict
    sections: dict[str, bytes] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        offset, index = 0, []
        for name, blob in self.sections.items():
            index.append({"name": name, "offset": offset, "size": len(blob),
                          "sha256": hashlib.sha256(blob).hexdigest()})
            offset += len(blob)
        manifest = json.dumps({**self.manifest, "sections": index}, sort_keys=True).encode()
        body = _HEADER.pack(MAGIC, FORMAT_VERSION, len(manifest)) + manifest + b"".join(
            self.sections.values())
        return body + hashlib.sha256(body).digest()

    def save(self, path: str | Path) -> Path:
        return write_atomically(path, lambda file: file.write(self.to_bytes()))

    @classmethod
    def from_bytes(cls, data: bytes, name: str = "artifact") -> "Artifact":
        if data[:len(MAGIC)] != MAGIC:
            raise ArtifactError(f"{name} is not a grape-tvm artifact (no GRAPETVM header)")
        if len(data) < _HEADER.size + _DIGEST:
            raise ArtifactError(f"{name} is damaged: truncated to {len(data)} bytes, shorter "
                                "than an artifact's header and checksum")
        _, version, manifest_len = _HEADER.unpack_from(data)
        if version != FORMAT_VERSION:
            raise ArtifactError(
                f"{name} has artifact format version {version}; this grape-tvm reads version "
                f"{FORMAT_VERSION}: compile the model again with this version")
        body, digest = data[:-_DIGEST], data[-_DIGEST:]
        if hashlib.sha256(body).digest() != digest:
            raise ArtifactError(f"{name} is damaged: its sha256 checksum does not match "
                                f"(truncated or edited file, {len(data)} bytes)")
        start = _HEADER.size
        try:
            manifest = json.loads(body[start:start + manifest_len])
        except ValueError as err:
            raise ArtifactError(f"{name} has an unreadable manifest: {err}") from None
        payload = start + manifest_len
        try:
            _check_manifest(manifest, len(body) - payload)
        except _Malformed as err:
            raise ArtifactError(f"{name} has a malformed manifest: {err}") from None
        sections = {}
        for entry in manifest["sections"]:
            lo = payload + entry["offset"]
            sections[entry["name"]] = body[lo:lo + entry["size"]]
        return cls(manifest, sections)

    @classmethod
    def load(cls, path: str | Path) -> "Artifact":
        path = Path(path)
        if path.is_dir():
            raise ArtifactError(f"{path} is a folder, expected an artifact file")
        if not path.is_file():
            raise ArtifactError(f"{path}: no such artifact file")
        return cls.from_bytes(path.read_bytes(), str(path))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()


# -- weights carried in the artifact ------------------------------------------------------

WEIGHT_PREFIX = "weight/"  # a section holding one input's whole value, as .npy


def weight_sections(weights: dict) -> dict[str, bytes]:
    """Sections holding ``weights`` (name to numpy array), each as .npy bytes."""
    sections = {}
    for name, value in weights.items():
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(value), allow_pickle=False)
        sections[WEIGHT_PREFIX + name] = buffer.getvalue()
    return sections


def stored_weights(artifact: "Artifact", names) -> dict:
    """The arrays of the weight sections ``names`` lists (``ArtifactError`` if one is
    missing or not an array of numbers)."""
    weights = {}
    for name in names:
        blob = artifact.sections.get(WEIGHT_PREFIX + name)
        if blob is None:
            raise ArtifactError(f"the manifest names weight {name!r}, and the artifact has no "
                                f"section {WEIGHT_PREFIX + name!r}")
        try:
            weights[name] = np.load(io.BytesIO(blob), allow_pickle=False)
        except ValueError as err:
            raise ArtifactError(f"section {WEIGHT_PREFIX + name!r} is not an .npy array: "
                                f"{err}") from None
    return weights


# -- the manifest's fields ---------------------------------------------------------------

# What may run an artifact's matmuls (``build(matmul=...)``, recorded as ``plan["matmul"]``).
MATMUL_IMPLEMENTATIONS = ("auto", "cublaslt", "grape", "tvm")


class _Each:
    """A JSON object of any keys, each value fitting ``schema``."""

    def __init__(self, schema):
        self.schema = schema


# The manifest fields grape reads when it loads, runs or describes an artifact, checked once
# here so that an edited or foreign manifest fails with the field's name, not deep inside.
# A dict lists an object's keys ("?": optional), a one-item list a list of such items, a
# type or tuple of types a value, a frozenset the values allowed.
_TENSOR = {"name": str, "dtype": str, "shape": [(int, str)],
           "kind?": frozenset({"tensor", "sequence"})}
_SIGNATURE = {"inputs": [_TENSOR], "outputs": [_TENSOR], "dims": _Each([int])}
_BRANCH_CALL = {"callee": str, "kind": str, "args": [int], "dims": [int]}
_ONNX_LOOP = {"node": str, "trip_count": (dict, type(None)), "cond": (dict, type(None)),
              "carried": [{"state": str, "init": dict}], "invariants": _Each(str),
              "outputs": [{"name": str, "source": dict}], "signature": _SIGNATURE}
_MANIFEST = {
    "target": {"kind": frozenset({"llvm", "cuda"}), "arch?": str},
    "signature": _SIGNATURE,
    "plan": {
        "regions": [{"name": str, "kernels": [str], "symbolic_vars": [str]}],
        "host_steps": [{"function": str, "var": str, "op": str, "reason": str}],
        "host_bookkeeping?": int,
        "conditionals?": [{"name": str, "condition": str, "mode": str, "then_calls": [str],
                           "else_calls": [str], "kernels": int}],
        "branches?": _Each({"condition": int, "dims": [str], "branches": [[_BRANCH_CALL]]}),
        "libraries?": [frozenset(LIBRARY_PREFIXES)],
        "matmul?": frozenset(MATMUL_IMPLEMENTATIONS),
        "gemv_rows?": _Each([int]),  # a library function -> its GEMV kernels' row buckets
        "transposed_inputs?": [str],  # inputs the executor transposes as it binds them
        "call_program?": dict,  # runtime.call_program's format (checked where it is read)
        "tensor_parallel?": {"world_size": int, "shard_plan": _Each(int),
                             "output_shard_plan": _Each(int),
                             # inputs whose whole values the artifact holds (weight_sections)
                             "weights?": [str],
                             # of those, each reordered by columns_by_ranks: its parts
                             "columns_by_ranks?": _Each(int)},
    },
    "loop?": {"carried": [str], "stop": str, "max_steps": int, "onnx?": _ONNX_LOOP},
    "sections": [{"name": str, "offset": int, "size": int, "sha256": str}],
    "cubins?": [str],
}
_TYPE_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer",
               type(None): "null"}


class _Malformed(ValueError):
    """A manifest field that does not fit ``_MANIFEST``; the message names it."""


def _field(where: str, key) -> str:
    return f"{where}.{key}" if where else str(key)


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fit(value, schema, where: str) -> None:
    """Raise ``_Malformed`` naming the first field of ``value`` that ``schema`` refuses."""
    if isinstance(schema, dict):
        _fit_type(value, dict, where)
        for key, item_schema in schema.items():
            name = key.rstrip("?")
            if name in value:
                _fit(value[name], item_schema, _field(where, name))
            elif not key.endswith("?"):
                raise _Malformed(f"field {_field(where, name)!r} is missing")
    elif isinstance(schema, list):
        _fit_type(value, list, where)
        for i, item in enumerate(value):
            _fit(item, schema[0], f"{where}[{i}]")
    elif isinstance(schema, _Each):
        _fit_type(value, dict, where)
        for key, item in value.items():
            _fit(item, schema.schema, _field(where, key))
    elif isinstance(schema, frozenset):
        if not (isinstance(value, str) and value in schema):
            raise _Malformed(f"field {where!r} is {_shown(value)}, expected one of "
                             f"{sorted(schema)}")
    else:
        _fit_type(value, schema, where)


def _fit_type(value, types, where: str) -> None:
    types = types if isinstance(types, tuple) else (types,)
    # JSON's true and false are Python bools, which are ints too: not an integer here.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        expected = " or ".join(_TYPE_NAMES[t] for t in types)
        what = f"field {where!r}" if where else "the manifest"
        raise _Malformed(f"{what} is {_shown(value)}, expected {expected}")


def _check_manifest(manifest, payload_size: int) -> None:
    """The manifest has every field loading reads, of its type; its dims are ranges and its
    sections lie in the payload."""
    _fit(manifest, _MANIFEST, "")
    for signature, where in _signatures(manifest):
        for kind in ("inputs", "outputs"):
            names = [spec.get("name") for spec in signature[kind]]
            if len(set(names)) != len(names):
                raise _Malformed(f"field {_field(where, kind)!r} names a tensor twice: {names}")
        for dim, bounds in signature["dims"].items():
            if len(bounds) != 2 or not 0 <= bounds[0] <= bounds[1] < 2**63:
                raise _Malformed(f"field {_field(where, 'dims.' + dim)!r} is {_shown(bounds)}, "
                                 "expected [lo, hi] with 0 <= lo <= hi < 2**63")
    for i, entry in enumerate(manifest["sections"]):
        if entry["offset"] < 0 or entry["size"] < 0 or \
                entry["offset"] + entry["size"] > payload_size:
            raise _Malformed(f"section {entry['name']!r} (sections[{i}]) lies outside the "
                             f"file's {payload_size} bytes of sections")
    if "library" not in {entry["name"] for entry in manifest["sections"]}:
        raise _Malformed("it has no 'library' section")


def _signatures(manifest: dict):
    yield manifest["signature"], "signature"
    onnx_loop = manifest.get("loop", {}).get("onnx")
    if onnx_loop is not None:
        yield onnx_loop["signature"], "loop.onnx.signature"
