"""CPU replay: a region's kernel calls recorded from TVM's VM, replayed without it.

The CPU counterpart of the CUDA graphs and the reference they are checked against: the same
regions, the same per-shape argument tables grouped by topology, TVM's CPU kernels. A
group keeps the kernels once; a shape is a row of its argument table.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Sequence

import tvm

from .argument_table import ArgumentTable, NodeRecord, TopologyGroups


def _slot(arg: Any, region_args: Sequence[Any]) -> tuple:
    """Where an argument comes from: ("param", i), ("const", address) or ("value",)."""
    if isinstance(arg, tvm.runtime.Tensor):
        for i, t in enumerate(region_args):
            if (isinstance(t, tvm.runtime.Tensor) and t.data_ptr() == arg.data_ptr()
                    and tuple(t.shape) == tuple(arg.shape) and str(t.dtype) == str(arg.dtype)):
                return ("param", i)
        return ("const", arg.data_ptr(), tuple(arg.shape), str(arg.dtype))
    return ("value",)


class CallRecorder:
    """Collects the kernel calls TVM's VM makes inside one region call (VM instrumentation)."""

    def __init__(self, region: str, shape: tuple, region_args: Sequence[Any]):
        self.region = region
        self.shape = shape
        self.region_args = list(region_args)
        self.calls: list[tuple[Any, str, tuple]] = []

    def on_call(self, func, symbol: str, args: Sequence[Any]) -> None:
        if symbol.startswith("vm.builtin."):
            return  # shape checks of the region function itself: host bookkeeping
        self.calls.append((func, symbol, tuple(args)))

    def records(self) -> tuple[list[NodeRecord], dict]:
        records, constants = [], {}
        for _, symbol, args in self.calls:
            slots = tuple(_slot(a, self.region_args) for a in args)
            for a, s in zip(args, slots):
                if s[0] == "const":
                    constants[s] = a  # weights: the group keeps them alive
            fields = tuple(a for a, s in zip(args, slots) if s[0] == "value")
            records.append(NodeRecord(symbol, slots, fields))
        return records, constants


class CpuGroup:
    """The kernels of one topology and the argument table of its shapes."""

    def __init__(self, recorder: CallRecorder, table: ArgumentTable, constants: dict):
        self.kernels = [func for func, _, _ in recorder.calls]
        self.names = [symbol for _, symbol, _ in recorder.calls]
        self.slots = [fixed for _, fixed in table.topology]
        self.table = table
        self.constants = constants

    def replay(self, row: int, region_args: Sequence[Any]) -> None:
        for kernel, slots, fields in zip(self.kernels, self.slots, self.table.fields(row)):
            values = iter(fields)
            args = [region_args[s[1]] if s[0] == "param" else
                    self.constants[s] if s[0] == "const" else next(values) for s in slots]
            kernel(*args)


class CpuReplayBackend:
    """Records each region per shape on first sight; replays its topology group's kernels.

    At most ``max_shapes`` shapes per region are held, the least recently used given up
    first (recorded again if they come back).
    """

    name = "cpu-replay"
    addresses_only = False  # the kernels take tensors
    # Recording runs the kernels (the VM calls them, the recorder watches): to record a
    # region without its effects the executor must skip them. A capture runs nothing.
    records_by_running = True

    def __init__(self, device: tvm.runtime.Device, max_shapes: int | None = None):
        self.device = device
        self.max_shapes = max_shapes
        self.launches = 0
        self.driver_ns = 0  # time in the replayed kernels themselves
        self._groups: dict[str, TopologyGroups] = {}
        self._kernels: dict[str, list[CpuGroup]] = {}

    def stream_context(self):
        return contextlib.nullcontext()

    def has(self, region: str, shape: tuple) -> bool:
        groups = self._groups.get(region)
        return groups is not None and shape in groups.where

    @property
    def shapes_held(self) -> int:
        """(region, shape) recordings held now."""
        return sum(len(groups.where) for groups in self._groups.values())

    @property
    def evicted(self) -> int:
        """Recordings given up so far to stay within ``max_shapes``."""
        return sum(groups.evicted for groups in self._groups.values())

    def replay(self, region: str, shape: tuple, region_args: Sequence[Any],
               caller: Any = None, moving: Sequence[int] | None = None,
               guards: Sequence[tuple[Any, Any]] = ()) -> bool:
        """Run ``region``'s kernels at ``shape``; False if it was never recorded there.

        ``guards``: ``(condition tensor, expect)`` pairs; the kernels run only if each
        condition is ``expect``, as the patch kernel decides on a GPU (host memory here:
        reading it is no synchronization).
        """
        groups = self._groups.get(region)
        where = groups.lookup(shape) if groups else None
        if where is None:
            return False
        if all(bool(condition.numpy()) == bool(expect) for condition, expect in guards):
            start = time.perf_counter_ns()
            self._kernels[region][where[0]].replay(where[1], region_args)
            self.driver_ns += time.perf_counter_ns() - start
        self.launches += 1
        return True  # a guard that fails: the call is done, with nothing run

    def ready(self, region: str, shape: tuple) -> None:
        """No launch kept ready here: a replay runs the kernels on its arguments as given."""
        return None

    def begin(self, region: str, shape: tuple, region_args: Sequence[Any]) -> CallRecorder:
        return CallRecorder(region, shape, region_args)

    def end(self, recorder: CallRecorder, run: bool = True) -> None:
        # The VM ran the kernels while they were recorded (unless the executor skipped
        # them: ``run`` False, see ``records_by_running``): the results are in place.
        records, constants = recorder.records()
        groups = self._groups.setdefault(recorder.region, TopologyGroups(self.max_shapes))
        placed = groups.add(recorder.shape, records)
        if placed.new_table:
            self._kernels.setdefault(recorder.region, []).append(
                CpuGroup(recorder, groups.tables[placed.table], constants))
        else:
            self._kernels[recorder.region][placed.table].constants.update(constants)

    def abort(self, recorder: CallRecorder) -> None:
        pass

    def recorded_shapes(self) -> dict[str, list[tuple]]:
        return {region: list(groups.where) for region, groups in self._groups.items()}

    def group(self, region: str, shape: tuple) -> CpuGroup:
        return self._kernels[region][self._groups[region].where[shape][0]]

    def synchronize(self) -> None:
        pass

    def describe(self) -> dict:
        return {"backend": self.name, "mode": "topology",
                "topology_groups": {r: g.describe() for r, g in self._groups.items()}}

    def close(self) -> None:
        self._groups.clear()
        self._kernels.clear()
