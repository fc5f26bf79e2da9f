"""Load a ``.grape`` artifact where the model is deployed: the TVM runtime is enough."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import tvm

from grape_tvm.artifact import Artifact, ArtifactError, write_atomically
from grape_tvm.runtime.call_program import CallProgram, ProgramError
from grape_tvm.runtime.cuda_compile import CubinStore, cache_dir
from grape_tvm.runtime.executor import DEFAULT_MAX_SHAPES, GraphExecutor
from grape_tvm.runtime.nccl import LIBRARY as NCCL
from grape_tvm.runtime.nccl import CollectiveGroup
from grape_tvm.runtime.nccl import register_functions as register_nccl_functions
from grape_tvm.runtime.signature import Signature


def _device(device: Any) -> tvm.runtime.Device:
    if isinstance(device, tvm.runtime.Device):
        return device
    kind, _, index = device.partition(":") if isinstance(device, str) else ("", "", "")
    if kind not in ("cpu", "cuda") or not re.fullmatch(r"[0-9]*", index):
        raise ValueError(f"device must be cpu or cuda[:N], got {device!r}")
    return tvm.device(kind, int(index or 0))


def _load_cuda_runtime(artifact: str | Path) -> None:
    """Runtime-only TVM does not load its CUDA backend by itself (shared/gpu/README.md)."""
    if tvm.cuda(0).exist:
        return
    libs = getattr(tvm.base, "_LOADED_LIBS", {})
    runtime = libs.get("tvm_runtime") if isinstance(libs, dict) else None
    if runtime is not None:
        path = os.path.join(os.path.dirname(runtime._name), "libtvm_runtime_cuda.so")
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as err:  # it links the driver's libcuda.so.1: no driver, no GPU
                raise RuntimeError(f"{artifact} runs on a CUDA GPU, and no CUDA driver is "
                                   f"available here ({err})") from None


def _library_path(artifact: Artifact) -> Path:
    # A .so must be a file to be loaded; one file per library content, reused across loads.
    digest = hashlib.sha256(artifact.sections["library"]).hexdigest()
    path = cache_dir() / "lib" / f"{digest}.so"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, lambda file: file.write(artifact.sections["library"]))
        except OSError as err:
            raise type(err)(err.errno, f"grape-tvm's cache {cache_dir()} cannot hold the "
                            f"artifact's library ({err.strerror}): set GRAPE_TVM_CACHE to a "
                            "writable folder") from None
    return path


# TVM 0.27 keeps about 85 KiB of host memory each time it loads a library, however often the
# same file is loaded (bench/memory.py): each artifact's library is loaded once per process
# and shared by the executors of it (a VM keeps its own state apart from its library).
_LIBRARIES: dict[Path, tvm.runtime.Module] = {}
_LIBRARIES_LOCK = threading.Lock()  # threads load at once (a threaded tensor-parallel session)


def _library(artifact: Artifact) -> tvm.runtime.Module:
    path = _library_path(artifact)
    with _LIBRARIES_LOCK:
        module = _LIBRARIES.get(path)
        if module is None:
            module = _LIBRARIES[path] = tvm.runtime.load_module(str(path))
    return module


def load_library(path: str | Path, device: Any = "cpu") -> tuple[Any, dict, tvm.runtime.Device]:
    """The artifact's TVM library, loadable by TVM's own VM, with its manifest and device."""
    library, manifest, dev, _ = _open(path, device)
    return library, manifest, dev


def entry_argument(manifest: dict, name: str, value: Any, device: tvm.runtime.Device) -> Any:
    """Input ``name`` as the entry function takes it, for a caller of TVM's VM on
    ``load_library``'s library: a weight the build reads transposed
    (``plan["transposed_inputs"]``, which ``GraphExecutor.bind_inputs`` transposes)
    transposed onto ``device``; any other input as it is."""
    if name not in manifest["plan"].get("transposed_inputs", ()):
        return value
    host = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
    return tvm.runtime.tensor(np.ascontiguousarray(host.T), device)


def _open(path: str | Path, device: Any):
    artifact = Artifact.load(path)
    manifest = artifact.manifest
    kind = manifest["target"]["kind"]
    dev = _device(device)
    wanted = "cuda" if kind == "cuda" else "cpu"
    if dev.dlpack_device_type() != tvm.device(wanted, 0).dlpack_device_type():
        raise ArtifactError(f"{path} was compiled for {kind} and runs on {wanted}, not on "
                            f"{device!r}: compile it again with --target "
                            f"{'cuda' if wanted == 'cpu' else 'llvm'}")
    if kind == "cuda":
        _load_cuda_runtime(path)
        if not tvm.cuda(dev.index).exist:
            raise RuntimeError(f"{path} needs a CUDA GPU, and none is visible here")
        store = CubinStore(manifest["target"].get("arch", "sm_90"))
        store.add({name.split("/", 1)[1]: blob for name, blob in artifact.sections.items()
                   if name.startswith("cubin/")})
        store.install()
    else:
        store = None
    return _library(artifact), manifest, dev, store


def _transposed_inputs(path, manifest: dict, signature: Signature) -> list[str]:
    """The plan's ``transposed_inputs``, each a matrix of static shape the model takes."""
    names = manifest["plan"].get("transposed_inputs", [])
    shapes = {t.name: t.shape for t in signature.inputs}
    wrong = [n for n in names if n not in shapes or len(shapes[n]) != 2 or
             not all(isinstance(d, int) for d in shapes[n])]
    if wrong:
        raise ArtifactError(f"{path}: plan.transposed_inputs names {wrong}, which are not "
                            "inputs of static 2-D shape")
    return names


def load(path: str | Path, device: Any = "cpu", *, graph_mode: str = "topology",
         max_graphs: int = 4096, max_shapes: int = DEFAULT_MAX_SHAPES,
         collectives: CollectiveGroup | None = None) -> GraphExecutor:
    """Load an artifact and return an executor on ``device`` (``"cpu"`` or ``"cuda"``).

    On CUDA, ``graph_mode="topology"`` keeps one graph per topology with per-shape argument
    tables applied on the device; ``"per-shape"`` keeps one graph per shape, at most
    ``max_graphs`` (least recently used evicted). Plans and recordings are kept for at most
    ``max_shapes`` dims (per region), least recently used given up first.
    ``collectives``: a tensor-parallel rank's place in its group, for the NCCL communicator
    its CUDA graphs' collectives run on (``TensorParallelSession`` gives it; on the CPU
    they are the disco session's).
    """
    library, manifest, dev, cubins = _open(path, device)
    signature = Signature.from_json(manifest["signature"])
    try:
        program = CallProgram.from_plan(manifest["plan"])
    except ProgramError as err:
        raise ArtifactError(f"{path}: {err}") from None
    backend = None
    libraries = manifest["plan"].get("libraries", ())
    if NCCL in libraries:  # TVM's VM looks its functions up as it loads (CPU: disco's)
        register_nccl_functions()
    if manifest["target"]["kind"] == "cuda":
        from grape_tvm.runtime.cuda_backend import CudaGraphBackend  # pylint: disable=import-outside-toplevel

        backend = CudaGraphBackend(dev, graph_mode, max_graphs, manifest["target"].get("arch"),
                                   cubins, max_shapes, libraries, collectives)
    executor = GraphExecutor(library, dev, signature, backend, program=program,
                             branches=manifest["plan"].get("branches"), max_shapes=max_shapes,
                             transposed_inputs=_transposed_inputs(path, manifest, signature))
    executor.manifest = manifest
    return executor
