"""A runtime library's packed functions: registered once with TVM, and the instance of the
library (handle, workspace, kernels) their calls on this thread use; and the vendor library
itself, found where the process, the system or a pip package has it."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence


def packaged_libraries(folders: Sequence[str], pattern: str) -> list[Path]:
    """Files matching ``pattern`` in the ``nvidia`` pip packages' ``folders`` (e.g.
    ``cu13/lib``), newest first: pip puts them where the loader does not look."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or ()) if spec else []
    return [path for root in roots for folder in folders
            for path in sorted(Path(root, folder).glob(pattern), reverse=True)]


def load_shared_library(sonames: Sequence[str], packaged: Sequence[Path]) -> ctypes.CDLL | None:
    """The first of ``sonames`` (one the process or the system has) that loads, else the
    first of the ``packaged`` files; None if none does."""
    for name in [*sonames, *(str(path) for path in packaged)]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def register_once(functions: Mapping[str, Any], packed: Callable[[Any], Callable]) -> None:
    """Register ``packed(function)`` with TVM under each name of ``functions`` not yet
    registered (the library's functions, by their packed names)."""
    import tvm  # pylint: disable=import-outside-toplevel

    for name, function in functions.items():
        if tvm.get_global_func(name, allow_missing=True) is None:
            tvm.register_global_func(name, packed(function))


class ThreadInstances:
    """Which instance of a library (its handle, workspace, kernels) a packed function called
    on this thread uses: the one a grape backend made active for its calls and captures
    (``activated``), else this thread's own for the device, made on first use (TVM's VM on
    the library, outside a backend) and kept for the thread's life, as TVM's cuBLAS runtime
    keeps a handle per thread."""

    def __init__(self, make: Callable[[int], Any]):
        self._make = make  # device index -> a new instance
        self._local = threading.local()

    @contextlib.contextmanager
    def activated(self, instance: Any) -> Iterator[Any]:
        """``instance`` is this thread's meanwhile (nesting restores the one before)."""
        before = getattr(self._local, "active", None)
        self._local.active = instance
        try:
            yield instance
        finally:
            self._local.active = before

    def current(self, device_index: int) -> Any:
        active = getattr(self._local, "active", None)
        if active is not None:
            return active
        own = self._local.__dict__.setdefault("own", {})
        if device_index not in own:
            own[device_index] = self._make(device_index)
        return own[device_index]
