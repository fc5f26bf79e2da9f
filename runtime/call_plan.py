"""A call at fixed dims, from the compiler's call program, on buffers the executor owns.

``PlannedCall`` is the call program evaluated at one call's dims (``CallProgram.at``) and
placed on the executor's ``BufferPool``: for each region launch, the argument list the
backend replays (pool buffers as addresses or views, the call's inputs filled in per call)
and the outputs. No TVM VM runs: the backend replays each region's recording.

Buffers are owned by the ``BufferPool`` (one per program storage, as large as the largest
dims have needed). Graph parameters follow them wherever they live: the backend re-points
region arguments on every launch. Outputs are views of pool buffers, valid until a later
call writes the same side (see ``BufferPool``), as with PyTorch's graph outputs.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import tvm
import tvm_ffi

from .call_program import Arg, Launch, ProgramAt

MEMO_LIMIT = 1 << 16  # entries of the pool's shared caches before they start over


class Address(int):
    """A device address standing in for a tensor where a backend reads only addresses
    (CUDA graphs): far cheaper to make than a tensor view, and made once per plan."""

    def data_ptr(self) -> int:
        return int(self)


class BufferPool:
    """Executor-owned device buffers, one per program storage, grown to the largest size
    asked for.

    Storages that hold a call's outputs have two sides: a call writes its outputs on the
    side its inputs do not live on, so that the outputs of one call fed to the next (a
    decode loop's KV cache) are read in place while the new ones are written beside them.
    An output is therefore overwritten by the second call after it at the latest, and by
    the next call when that call's inputs are not the executor's outputs.
    """

    def __init__(self, device: tvm.runtime.Device):
        self.device = device
        self.buffers: list[list[Any]] = []  # per storage: [side 0] or [side 0, side 1]
        self.generation = 0  # bumped when a buffer moves: views made before are stale
        # What planned calls of every dims share, valid for one generation: addresses and
        # output views. A decode loop meets new dims on every step.
        self._memo: dict[Any, Any] = {}
        self._memo_generation = 0
        self._shapes: dict[tuple, tvm_ffi.Shape] = {}

    def reserve(self, index: int, nbytes: int, sides: int = 1) -> None:
        while len(self.buffers) <= index:
            self.buffers.append([])
        held = self.buffers[index]
        while len(held) < sides:
            held.append(None)
        for side, current in enumerate(held):
            if current is None or current.shape[0] < nbytes:
                # Grow geometrically: a KV cache growing one row per call reallocates rarely.
                size = max(nbytes, 2 * current.shape[0] if current is not None else 0, 1)
                held[side] = tvm.runtime.empty((size,), "uint8", self.device)
                self.generation += 1

    def close(self) -> None:
        """Give every buffer up: views made before are stale."""
        self.buffers.clear()
        self._memo.clear()
        self._shapes.clear()
        self.generation += 1

    def shared(self, key: Any, make) -> Any:
        """``make()``, made once per generation for ``key``."""
        if self._memo_generation != self.generation or len(self._memo) > MEMO_LIMIT:
            self._memo, self._memo_generation = {}, self.generation
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = make()
        return found

    def view(self, index: int, offset: int, shape: tuple, dtype: str, side: int = 0):
        ffi_shape = self._shapes.get(shape)
        if ffi_shape is None:  # building a Shape costs more than the view itself
            if len(self._shapes) > MEMO_LIMIT:
                self._shapes.clear()
            ffi_shape = self._shapes[shape] = tvm_ffi.Shape(shape)
        return self._buffer(index, side)._create_view(ffi_shape, dtype, offset)

    def address(self, index: int, offset: int, side: int = 0) -> Address:
        return self.shared(("address", index, offset, side),
                           lambda: Address(self._buffer(index, side).data_ptr() + offset))

    def _buffer(self, index: int, side: int):
        held = self.buffers[index]
        return held[side if side < len(held) else 0]

    def _ranges(self) -> tuple[list[int], list[tuple[int, Any]]]:
        """Buffer start addresses, sorted, and (end, side) of each: side 0 or 1 for output
        buffers, "single" for the rest. Made once per generation."""
        def make():
            ranges = sorted((b.data_ptr(), b.data_ptr() + b.shape[0],
                             side if len(held) > 1 else "single")
                            for held in self.buffers for side, b in enumerate(held) if b is not None)
            return [r[0] for r in ranges], [(r[1], r[2]) for r in ranges]

        return self.shared(("ranges",), make)

    def side_for(self, tensors: Sequence[Any], hit: set | None = None) -> int | None:
        """The output side none of ``tensors`` lives on, nor any side in ``hit`` (those of
        tensors known to be output views); None if they live in buffers a call would
        overwrite whichever side it takes."""
        starts, ends = self._ranges()
        hit = set(hit or ())
        for t in tensors:
            address = t.data_ptr()
            i = bisect.bisect_right(starts, address) - 1
            if i >= 0 and address < ends[i][0]:
                if ends[i][1] == "single":
                    return None
                hit.add(ends[i][1])
        free = [side for side in (0, 1) if side not in hit]
        return free[0] if free else None


@dataclass(eq=False)
class LaunchArgs:
    """One region launch's arguments on one side of the pool, as the backend replays them.

    ``values`` holds every argument; the positions in ``inputs`` are overwritten with the
    call's inputs on every call (in place: the list belongs to this launch), and those in
    ``outputs`` with a caller's ``out=`` tensor when one is given. ``caller`` is the same
    for launches of any dims whose other arguments sit at the same addresses: between two
    such launches only ``moving`` can change (``TopologyGraph.replay``).
    """

    launch: Launch
    values: list
    inputs: tuple[tuple[int, int], ...]  # (position, input index)
    input_views: tuple[tuple[int, int, tuple, str], ...]  # (position, input, shape, dtype)
    outputs: tuple[tuple[int, int, Any, int, tuple, str], ...]  # (position, output storage,
    # the pool's value, offset, shape, dtype)
    moving: tuple[int, ...]
    caller: tuple
    guards: list  # (condition, expect); a condition read from an input is filled per call
    guard_inputs: tuple[tuple[int, int], ...]  # (guard index, input index)
    redirected: bool = False  # an output position holds a caller's out= tensor


class PlannedCall:
    """The launches and outputs of one call at fixed dims (see the module docstring)."""

    def __init__(self, at: ProgramAt, output_storages: frozenset[int], pool: BufferPool,
                 bound: Mapping[int, Any] | None = None, bound_version: int = 0):
        self.at = at
        self.launches = at.launches
        self.output_storages = output_storages
        # Inputs bound once (weights): placed like the pool's buffers, not filled per call.
        self.bound = dict(bound or {})
        self.bound_version = bound_version
        for index, nbytes in enumerate(at.storage_bytes):
            pool.reserve(index, nbytes, sides=2 if index in output_storages else 1)
        self._placed: dict[int, tuple[int, list[LaunchArgs], list, dict]] = {}  # per side

    @property
    def guarded(self) -> bool:
        return self.at.guarded

    def recorded(self, backend) -> bool:
        """Whether the backend holds a recording of every launch (one may be evicted)."""
        return all(backend.has(launch.region, launch.shape) for launch in self.launches)

    def _output_storage(self, index: int) -> int | None:
        """The storage output ``index`` alone is a view of (at offset 0), else None."""
        arg = self.at.outputs[index]
        if arg.kind != "view" or self.at.views[arg.index][0] != "storage" or \
                self.at.views[arg.index][2] != 0:
            return None
        storage = self.at.views[arg.index][1]
        sharing = [a for a in self.at.outputs
                   if a.kind == "view" and self.at.views[a.index][:2] == ("storage", storage)]
        return storage if len(sharing) == 1 else None

    def output_spec(self, index: int) -> tuple[tuple, str] | None:
        """(shape, dtype) of output ``index`` if a caller's tensor can stand in for its
        storage (``out=``), else None."""
        if self._output_storage(index) is None:
            return None
        view = self.at.views[self.at.outputs[index].index]
        return view[3], view[4]

    def redirect(self, out: dict[int, Any]) -> dict[int, Any]:
        """``out`` (output index -> tensor) by the storage each stands in for."""
        return {self._output_storage(i): target for i, target in out.items()}

    # -- placing on the pool ---------------------------------------------------------------
    def placed(self, pool: BufferPool, side: int, addresses_only: bool
               ) -> tuple[list[LaunchArgs], list, dict]:
        """The launch arguments, the outputs and ``described`` (see ``described``) on
        ``side``: made once per pool generation and side."""
        found = self._placed.get(side)
        if found is None or found[0] != pool.generation:
            found = self._placed[side] = (pool.generation, *self._place(pool, side, addresses_only))
        return found[1], found[2], found[3]

    def _side(self, storage: int, side: int) -> int:
        return side if storage in self.output_storages else 0

    def _pool_value(self, arg: Arg, pool: BufferPool, side: int, addresses_only: bool):
        base, index, offset, shape, dtype = self.at.views[arg.index]
        side = self._side(index, side)
        if addresses_only:
            return pool.address(index, offset, side)
        return pool.shared(("view", index, offset, side, shape, dtype),
                           lambda: pool.view(index, offset, shape, dtype, side))

    def _place(self, pool: BufferPool, side: int, addresses_only: bool):
        launches = []
        for launch in self.launches:
            values, inputs, input_views, outputs, layout = [], [], [], [], []
            for position, arg in enumerate(launch.args):
                value, what = self._value(arg, position, pool, side, addresses_only,
                                          inputs, input_views, outputs)
                values.append(value)
                layout.append(what)
            guards, guard_inputs = [], []
            for g, (condition, expect) in enumerate(launch.guards):
                if condition.kind == "input" or self.at.views[condition.index][0] == "input":
                    index = condition.index if condition.kind == "input" else \
                        self.at.views[condition.index][1]
                    guard_inputs.append((g, index))
                    guards.append((None, expect))
                else:
                    guards.append((self._pool_value(condition, pool, side, addresses_only),
                                   expect))
            moving = tuple(p for p, _ in inputs) + tuple(p for p, *_ in input_views) + \
                tuple(p for p, *_ in outputs)
            caller = (pool.generation, self.bound_version, launch.region, tuple(layout))
            launches.append(LaunchArgs(launch, values, tuple(inputs), tuple(input_views),
                                       tuple(outputs), moving, caller, guards,
                                       tuple(guard_inputs)))
        outputs = [None if a.kind == "input" else
                   tvm_ffi.Shape(a.value) if a.kind == "shape" else
                   a.value if a.kind == "value" else
                   self._output_view(a, pool, side) for a in self.at.outputs]
        described = {id(view): (view, self.at.views[a.index][3], self.at.views[a.index][4], side)
                     for a, view in zip(self.at.outputs, outputs)
                     if a.kind == "view" and self.at.views[a.index][0] == "storage"}
        return launches, outputs, described

    def _value(self, arg: Arg, position: int, pool, side, addresses_only,
               inputs: list, input_views: list, outputs: list) -> tuple[Any, Any]:
        """An argument's value on the pool, and what it is (the launch's caller key)."""
        if arg.kind == "input" and arg.index in self.bound:
            tensor = self.bound[arg.index]
            return (Address(tensor.data_ptr()) if addresses_only else tensor), ("bound", arg.index)
        if arg.kind == "input":
            inputs.append((position, arg.index))
            return None, "input"
        if arg.kind == "value":
            return arg.value, "scalar"  # a dim by value: no address, differs between dims
        if arg.kind == "shape":
            return tvm_ffi.Shape(arg.value), "shape"
        base, index, offset, shape, dtype = self.at.views[arg.index]
        if base == "input":
            input_views.append((position, index, shape, dtype))
            return None, "input"
        value = self._pool_value(arg, pool, side, addresses_only)
        if index in self.output_storages:
            outputs.append((position, index, value, offset, shape, dtype))
            return value, ("output", index, offset)
        return value, ("buffer", index, offset)

    def _output_view(self, arg: Arg, pool: BufferPool, side: int):
        base, index, offset, shape, dtype = self.at.views[arg.index]
        if base == "input":
            return None  # filled per call
        side = self._side(index, side)
        return pool.shared(("view", index, offset, side, shape, dtype),
                           lambda: pool.view(index, offset, shape, dtype, side))

    # -- one call --------------------------------------------------------------------------
    def fill(self, launch: LaunchArgs, inputs: Sequence[Any], redirect: dict[int, Any] | None,
             addresses_only: bool) -> None:
        """Put this call's inputs (and ``out=`` targets, by output storage) into ``launch``."""
        values = launch.values
        for position, index in launch.inputs:
            values[position] = inputs[index]
        for position, index, shape, dtype in launch.input_views:
            source = inputs[index]
            values[position] = Address(source.data_ptr()) if addresses_only else \
                source._create_view(tvm_ffi.Shape(shape), dtype)
        if redirect or launch.redirected:
            for position, storage, pool_value, offset, shape, dtype in launch.outputs:
                target = redirect.get(storage) if redirect else None
                values[position] = pool_value if target is None else \
                    Address(target.data_ptr() + offset) if addresses_only else \
                    target._create_view(tvm_ffi.Shape(shape), dtype, offset)
            launch.redirected = bool(redirect)
        for g, index in launch.guard_inputs:
            launch.guards[g] = (inputs[index], launch.guards[g][1])

    def outputs(self, placed: list, inputs: Sequence[Any], out: dict[int, Any] | None) -> list:
        """The call's outputs: pool views, inputs passed through, the caller's ``out=``."""
        results = []
        for i, (arg, held) in enumerate(zip(self.at.outputs, placed)):
            if out and i in out:
                results.append(out[i])
            elif arg.kind == "input":
                results.append(inputs[arg.index])
            elif held is None:  # a view of an input
                _, index, _, shape, dtype = self.at.views[arg.index]
                results.append(inputs[index]._create_view(tvm_ffi.Shape(shape), dtype))
            else:
                results.append(held)
        return results

    def tensors(self, launch: Launch, inputs: Sequence[Any], pool: BufferPool, side: int,
                redirect: dict[int, Any] | None = None) -> list:
        """``launch``'s arguments as tensors (pool views, inputs, ``redirect``'s out=
        tensors) and values: what TVM's VM takes to issue the region function (recording,
        a device loop's body)."""
        args = []
        for arg in launch.args:
            if arg.kind == "input":
                args.append(inputs[arg.index])
            elif arg.kind == "value":
                args.append(arg.value)
            elif arg.kind == "shape":
                args.append(tvm_ffi.Shape(arg.value))
            else:
                base, index, offset, shape, dtype = self.at.views[arg.index]
                if base == "input":
                    args.append(inputs[index]._create_view(tvm_ffi.Shape(shape), dtype))
                elif redirect and index in redirect:
                    args.append(redirect[index]._create_view(tvm_ffi.Shape(shape), dtype, offset))
                else:
                    args.append(pool.view(index, offset, shape, dtype, self._side(index, side)))
        return args

    def guards_as_tensors(self, launch: Launch, inputs: Sequence[Any], pool: BufferPool,
                          side: int) -> list[tuple[Any, bool]]:
        """``launch``'s guards with their conditions as tensors or addresses."""
        def condition(arg: Arg):
            if arg.kind == "input":
                return inputs[arg.index]
            base, index = self.at.views[arg.index][:2]
            return inputs[index] if base == "input" else \
                self._pool_value(arg, pool, side, addresses_only=False)

        return [(condition(c), e) for c, e in launch.guards]
