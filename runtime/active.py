"""The instance of a library that packed-function calls on this thread use."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator


@contextlib.contextmanager
def activated(slot: threading.local, instance: Any) -> Iterator[Any]:
    """Make ``instance`` ``slot.instance`` on this thread meanwhile (nesting restores the
    one before): a backend's library state, used by the calls TVM's VM makes during its
    calls and captures."""
    before = getattr(slot, "instance", None)
    slot.instance = instance
    try:
        yield instance
    finally:
        slot.instance = before
