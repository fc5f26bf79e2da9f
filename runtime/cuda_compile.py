"""CUDA kernels of an artifact: cubins built at compile time, or built once at load and cached.

TVM's CUDA build without a GPU keeps kernels as CUDA source; when such a library is loaded,
TVM asks the process-wide global function ``tvm_callback_cuda_compile`` for a binary. The
``CubinStore`` answers from the cubins an artifact carries, else compiles with ``nvcc`` and
keeps the result on disk, so a kernel is compiled once per machine, not on every load.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Sequence


def source_key(code: str) -> str:
    return hashlib.sha256(code.encode()).hexdigest()


def nvcc_available() -> bool:
    return shutil.which("nvcc") is not None


def compile_cubin(code: str, arch: str) -> bytes:
    """Compile CUDA source to a cubin for ``arch`` (``sm_90``) with nvcc."""
    if not nvcc_available():
        raise RuntimeError("nvcc is not on PATH: cannot compile the model's CUDA kernels")
    with tempfile.TemporaryDirectory(prefix="grape-nvcc-") as tmp:
        src, out = Path(tmp, "kernels.cu"), Path(tmp, "kernels.cubin")
        src.write_text(code)
        cmd = ["nvcc", "--cubin", f"-arch={arch}", "-O3", "-o", str(out), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for {arch}:\n{proc.stderr[-4000:]}")
        return out.read_bytes()


def cache_dir() -> Path:
    root = os.environ.get("GRAPE_TVM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "grape-tvm")
    return Path(root)


class CubinStore:
    """Cubins by source hash: from artifacts first, then the disk cache, then nvcc."""

    def __init__(self, arch: str):
        self.arch = arch
        self._known: dict[str, bytes] = {}
        self.compiled = 0

    def add(self, cubins: dict[str, bytes]) -> None:
        self._known.update(cubins)

    def lookup(self, code: str) -> bytes:
        key = source_key(code)
        if key in self._known:
            return self._known[key]
        path = cache_dir() / "cubin" / f"{key}-{self.arch}.cubin"
        if path.exists():
            return path.read_bytes()
        cubin = compile_cubin(code, self.arch)
        self.compiled += 1
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(cubin)
        tmp.replace(path)
        self._known[key] = cubin
        return cubin

    def install(self) -> None:
        """Answer TVM's ``tvm_callback_cuda_compile`` from this store (process-wide)."""
        import tvm_ffi  # pylint: disable=import-outside-toplevel

        def tvm_callback_cuda_compile(code, *_):
            return bytearray(self.lookup(str(code)))

        tvm_ffi.register_global_func("tvm_callback_cuda_compile", tvm_callback_cuda_compile,
                                     override=True)


class RuntimeKernel:
    """One of the runtime's own kernels (``runtime/kernels/*.cu``), loaded from its cubin.

    The cubin comes from the artifact (built beside the model's kernels), else from the
    cache or nvcc (``CubinStore``). Owns its CUmodule; ``close()`` unloads it.
    """

    def __init__(self, store: CubinStore, source: Path, name: str):
        from .cuda_driver import check, driver  # pylint: disable=import-outside-toplevel

        self._driver = driver
        cubin = store.lookup(source.read_text())
        self.module = check(driver.cuModuleLoadData(cubin), f"cuModuleLoadData({source.name})")
        self.function = check(driver.cuModuleGetFunction(self.module, name.encode()),
                              f"cuModuleGetFunction({name})")

    def close(self) -> None:
        if self.module is not None:
            self._driver.cuModuleUnload(self.module)
            self.module = None


_PARAMETER_TYPES = {"u64": ctypes.c_uint64, "u32": ctypes.c_uint32, "i64": ctypes.c_int64,
                    "i32": ctypes.c_int32, "f32": ctypes.c_float}


def kernel_params(values: Sequence[tuple[str, Any]]):
    """ctypes storage for a kernel's parameters, each ``(kind, value)`` with kind one of
    ``_PARAMETER_TYPES``; keep the result alive until the launch (its array's address is
    ``cuLaunchKernel``'s ``kernelParams``)."""
    boxes = [_PARAMETER_TYPES[kind](value) for kind, value in values]
    array = (ctypes.c_void_p * len(boxes))(*[ctypes.addressof(b) for b in boxes])
    return boxes, array
