"""The ``.grape`` artifact: one file, versioned and checksummed.

Layout (little endian)::

    b"GRAPETVM"            8 bytes magic
    format version         u32
    manifest length        u64
    manifest               UTF-8 JSON: signature, target, graph plan, sections
    sections               the compiled library (.so) and any cubins, back to back
    sha256                 32 bytes, over everything before it

Reading needs only the TVM runtime: nothing here imports the compiler.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"GRAPETVM"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIQ")
_DIGEST = 32


class ArtifactError(ValueError):
    """The file is not a loadable grape artifact; the message says why."""


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
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(self.to_bytes())
        tmp.replace(path)  # never leave a half-written artifact under the real name
        return path

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
        sections = {}
        for entry in manifest.get("sections", []):
            lo = payload + entry["offset"]
            sections[entry["name"]] = body[lo:lo + entry["size"]]
        return cls(manifest, sections)

    @classmethod
    def load(cls, path: str | Path) -> "Artifact":
        path = Path(path)
        if not path.is_file():
            raise ArtifactError(f"{path}: no such artifact file")
        return cls.from_bytes(path.read_bytes(), str(path))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()
