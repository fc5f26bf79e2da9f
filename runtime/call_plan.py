"""A whole call without TVM's VM: the regions it runs, on buffers the executor owns.

When the entry function has no host step (only allocations, shape checks and region calls),
a call at given dims always runs the same regions on tensors that are either the call's
inputs or memory the VM allocated for it. The first call at those dims runs on the VM and
is watched (``CallPlanRecorder``); later ones run the ``CallPlan``: each region replayed by
the backend on the inputs and on executor-owned buffers, with no VM and no instrumentation.

Buffers are owned by the ``BufferPool`` (one per executor, each buffer as large as the
largest shape has needed). Graph parameters follow them wherever they live: the backend
re-points region arguments on every launch. Outputs are views of pool buffers, valid until
the next call, as with PyTorch's graph outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import tvm


@dataclass(frozen=True)
class Slot:
    """Where a region argument or an output comes from on a planned call."""

    kind: str  # "input" (index into the call's inputs), "buffer" (pool buffer) or "value"
    index: int = 0
    shape: tuple = ()
    dtype: str = ""
    value: Any = None


def _nbytes(t) -> int:
    return int(np.prod(t.shape, dtype=np.int64)) * np.dtype(str(t.dtype)).itemsize


class BufferPool:
    """Executor-owned device buffers, one per slot, grown to the largest size asked for."""

    def __init__(self, device: tvm.runtime.Device):
        self.device = device
        self.buffers: list[Any] = []
        self.generation = 0  # bumped when a buffer moves: views made before are stale

    def reserve(self, index: int, nbytes: int) -> None:
        while len(self.buffers) <= index:
            self.buffers.append(None)
        current = self.buffers[index]
        if current is None or current.shape[0] < nbytes:
            self.buffers[index] = tvm.runtime.empty((max(nbytes, 1),), "uint8", self.device)
            self.generation += 1

    def view(self, index: int, shape: tuple, dtype: str):
        return self.buffers[index]._create_view(shape, dtype)

    def spans(self) -> list[tuple[int, int]]:
        return [(b.data_ptr(), b.shape[0]) for b in self.buffers if b is not None]

    @property
    def nbytes(self) -> int:
        return sum(b.shape[0] for b in self.buffers if b is not None)


class CallPlan:
    """The regions of one call at fixed dims, and where each argument and output lives."""

    def __init__(self, regions: list[tuple[str, tuple, list[Slot]]], outputs: list[Slot]):
        self.regions = regions
        self.outputs = outputs
        self._generation = -1
        self._args: list[tuple] = []  # (region, shape, values, inputs, their positions, caller)
        self._outs: list[Any] = []

    def _materialize(self, pool: BufferPool) -> None:
        # Views of pool buffers are made once per pool generation, not on every call.
        def fixed(slot: Slot):
            if slot.kind == "buffer":
                return pool.view(slot.index, slot.shape, slot.dtype)
            return slot.value

        self._args = []
        for region, shape, slots in self.regions:
            values = [None if s.kind == "input" else fixed(s) for s in slots]
            inputs = [(i, s.index) for i, s in enumerate(slots) if s.kind == "input"]
            # Plans of other dims whose region arguments sit in the same pool buffers at the
            # same places share this key: between them only the inputs move.
            caller = (pool.generation, region, tuple((s.kind, s.index) for s in slots))
            self._args.append((region, shape, values, inputs, [i for i, _ in inputs], caller))
        self._outs = [None if s.kind == "input" else fixed(s) for s in self.outputs]
        self._generation = pool.generation

    def run(self, inputs: Sequence[Any], pool: BufferPool, backend) -> list[Any] | None:
        """Launch every region; None (nothing launched) if one lost its recording."""
        if not all(backend.has(region, shape) for region, shape, _ in self.regions):
            return None  # evicted by a bounded per-shape cache: the VM records it again
        if self._generation != pool.generation:
            self._materialize(pool)
        for region, shape, values, from_inputs, moving, caller in self._args:
            args = list(values)
            for position, index in from_inputs:
                args[position] = inputs[index]
            backend.replay(region, shape, args, caller, moving)
        return [inputs[s.index] if s.kind == "input" else out
                for s, out in zip(self.outputs, self._outs)]


class CallPlanRecorder:
    """Watches one VM call's region calls and turns them into a ``CallPlan``, if it can.

    Inputs listed in ``fixed`` (bound once, such as weights) are kept as values: they do
    not move from call to call, so a replay need not look at their addresses.
    """

    def __init__(self, inputs: Sequence[Any], fixed: Sequence[int] = ()):
        self.inputs = list(inputs)
        self.fixed = set(fixed)
        self.calls: list[tuple[str, tuple, list[Any]]] = []

    def on_region(self, region: str, shape: tuple, args: Sequence[Any]) -> None:
        self.calls.append((region, shape, list(args)))

    def finish(self, outputs: Sequence[Any], pool: BufferPool,
               buffer_of: dict[tuple, int]) -> CallPlan | None:
        """The plan, or None when the call's memory cannot be re-created buffer by buffer.

        A tensor is named by where it first appears (region call, argument): the same name
        at every shape, so ``buffer_of`` (shared by all plans of an executor) gives it the
        same pool buffer at every shape, sized for the largest.
        """
        seen: dict[int, tuple[int, int]] = {}  # address -> (slot, nbytes)
        position = [0, 0]

        def slot(t) -> Slot | None:
            if not isinstance(t, tvm.runtime.Tensor):
                return Slot("value", value=t)
            for i, x in enumerate(self.inputs):
                if x.data_ptr() == t.data_ptr() and tuple(x.shape) == tuple(t.shape):
                    return Slot("value", value=x) if i in self.fixed else Slot("input", i)
            address, nbytes = t.data_ptr(), _nbytes(t)
            for other, (_, size) in seen.items():
                if other != address and other < address + nbytes and address < other + size:
                    return None  # overlapping views of one storage: keep the VM
            if address in seen:
                index = seen[address][0]
            else:
                index = buffer_of.setdefault(tuple(position), len(buffer_of))
            seen[address] = (index, max(nbytes, seen.get(address, (0, 0))[1]))
            return Slot("buffer", index, tuple(t.shape), str(t.dtype))

        regions = []
        for call, (region, shape, args) in enumerate(self.calls):
            slots = []
            for arg, value in enumerate(args):
                position[:] = [call, arg]
                slots.append(slot(value))
            if any(s is None for s in slots):
                return None
            regions.append((region, shape, slots))
        out_slots = []
        for i, value in enumerate(outputs):
            position[:] = [-1, i]
            out_slots.append(slot(value))
        if any(s is None or s.kind == "value" for s in out_slots):
            return None
        for index, nbytes in seen.values():
            pool.reserve(index, nbytes)
        return CallPlan(regions, out_slots)
