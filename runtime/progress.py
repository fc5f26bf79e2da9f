"""A progress line for long work (recording hundreds of shapes), on stderr."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``Progress(total, "recording")``; call ``step()`` per item, ``close()`` at the end."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None,
                 enabled: bool = True, every_s: float = 0.5):
        self.total, self.label, self.done = total, label, 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.every_s = every_s
        self.start = self._last = time.perf_counter()

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and (now - self._last >= self.every_s or self.done == self.total):
            self._last = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / rate if rate else 0.0
            self.stream.write(f"\r{self.label}: {self.done}/{self.total} "
                              f"({100 * self.done / max(self.total, 1):.0f}%, {rate:.0f}/s, "
                              f"{eta:.0f} s left)")
            self.stream.flush()

    def close(self) -> float:
        elapsed = time.perf_counter() - self.start
        if self.enabled:
            self.stream.write(f"\r{self.label}: {self.done}/{self.total} in {elapsed:.1f} s"
                              + " " * 20 + "\n")
            self.stream.flush()
        return elapsed
