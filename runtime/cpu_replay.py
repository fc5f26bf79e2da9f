"""CPU replay: a region's kernel launches recorded from TVM's VM, replayed without it.

The CPU counterpart of a CUDA graph, and the reference the GPU path is checked against:
the same regions, the same per-shape recordings, TVM's CPU kernels.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Sequence

import tvm

from .region import ArgSlot, bind_slots, slots_for


@dataclass
class KernelCall:
    """One recorded launch: the kernel and where each argument comes from."""

    kernel: Any  # tvm.runtime function
    name: str
    slots: tuple[ArgSlot, ...]


class CallRecording:
    """The kernels one region launched at one shape, replayable with new region arguments."""

    def __init__(self, calls: list[KernelCall]):
        self.calls = calls

    def replay(self, region_args: Sequence[Any]) -> None:
        for call in self.calls:
            call.kernel(*bind_slots(call.slots, region_args))

    @property
    def kernel_names(self) -> list[str]:
        return [c.name for c in self.calls]


class CallRecorder:
    """Collects the kernel calls TVM's VM makes inside one region call (VM instrumentation)."""

    def __init__(self, region_args: Sequence[Any]):
        self.region_args = list(region_args)
        self.calls: list[KernelCall] = []

    def on_call(self, func, symbol: str, args: Sequence[Any]) -> None:
        if symbol.startswith("vm.builtin."):
            return  # shape checks of the region function itself: host bookkeeping
        self.calls.append(KernelCall(func, symbol, slots_for(args, self.region_args)))

    def finish(self) -> CallRecording:
        return CallRecording(self.calls)


class CpuReplayBackend:
    """Records each region per shape on first sight and replays the recording afterwards."""

    name = "cpu-replay"

    def __init__(self, device: tvm.runtime.Device):
        self.device = device

    def begin(self, region_args: Sequence[Any]) -> CallRecorder:
        return CallRecorder(region_args)

    def end(self, recorder: CallRecorder) -> CallRecording:
        # The VM ran the kernels while they were recorded: the call's results are in place.
        return recorder.finish()

    def replay(self, recording: CallRecording, region_args: Sequence[Any]) -> None:
        recording.replay(region_args)

    def abort(self, recorder: CallRecorder) -> None:
        pass

    def stream_context(self):
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        pass

    def describe(self) -> dict:
        return {"backend": self.name}

    def close(self) -> None:
        pass
