"""One of grape's runtime kernels, built to a cubin, launched by the runtime on torch tensors
(``bench/attention_kernel.py``, ``bench/decode_attention.py``), and their results file."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


class CubinFile:
    """A ``CubinStore`` stand-in answering every source with one cubin, a build of the
    kernel's source (with the benchmark's own compile-time settings, maybe)."""

    def __init__(self, path: Path):
        self.cubin = path.read_bytes()

    def lookup(self, _code: str) -> bytes:
        return self.cubin


class RuntimeTensor:
    """A torch tensor as the runtime's libraries read one: its address and dtype's name."""

    def __init__(self, tensor: torch.Tensor):
        self.data_ptr = tensor.data_ptr
        self.dtype = str(tensor.dtype).removeprefix("torch.")


def write_results(out: Path, name: str, started: float, **fields) -> None:
    """Write ``out/name``: the machine, torch, the command and ``fields``; print where, and
    the seconds since ``started``."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps({"machine": torch.cuda.get_device_name(), "torch": torch.__version__,
                                "command": " ".join(sys.argv), **fields}, indent=1))
    print(f"wrote {path} in {time.time() - started:.0f} s")
