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
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import tvm
import tvm_ffi

from .call_program import Arg, Launch, ProgramAt, ViewAt

MEMO_LIMIT = 1 << 16  # entries of the pool's shared caches before they start over


class Address(int):
    """A device address standing in for a tensor where a backend reads only addresses
    (CUDA graphs): far cheaper to make than a tensor view, and made once per plan."""

    def data_ptr(self) -> int:
        return int(self)


def scalar_tensor(value: bool | int | float, dtype: str, device) -> tvm.runtime.Tensor:
    """A 0-d tensor of ``value``: an output the entry returns as a number (a value of the
    dims, as ``Shape(x)[0]``) is a tensor, like every other output."""
    return tvm.runtime.tensor(np.array(value, dtype=dtype), device)


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

    def value(self, view: ViewAt, side: int, addresses_only: bool):
        """``view`` of a buffer on ``side``: its address (``addresses_only``) or a tensor
        view, made once per generation."""
        if addresses_only:
            return self.address(view.index, view.offset, side)
        return self.shared(("view", view, side),
                           lambda: self.view(view.index, view.offset, view.shape, view.dtype, side))

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

    def where(self, tensor: Any) -> int | str | None:
        """The output side (0 or 1) ``tensor`` lives on, "single" if it lives in a buffer
        without sides, None if outside the pool."""
        starts, ends = self._ranges()
        address = tensor.data_ptr()
        i = bisect.bisect_right(starts, address) - 1
        if i >= 0 and address < ends[i][0]:
            return ends[i][1]
        return None

    def locate(self, facts: "TensorFacts") -> int | str | None:
        """Where ``facts``' tensor lives (``where``), looked up once per pool generation."""
        if facts.generation != self.generation:
            facts.where = self.where(facts.tensor)
            facts.generation = self.generation
        return facts.where


def free_side(taken: set) -> int | None:
    """The output side not in ``taken`` (what ``BufferPool.where`` says of a call's
    inputs); None if an input lives in a buffer without sides, or on both sides: a call
    would overwrite it whichever side it takes."""
    if "single" in taken:
        return None
    return 0 if 0 not in taken else 1 if 1 not in taken else None


@dataclass(eq=False, slots=True)
class TensorFacts:
    """What a call needs to know of a tensor passed to it, found once per tensor rather
    than once per call (a TVM tensor's shape, dtype and memory never change): the tensor,
    its shape and dtype, whether it is small enough to be remembered past the next call
    (``small``; None for the executor's own outputs, which are never remembered), and where
    it lives in the pool (``BufferPool.where``) as of pool generation ``generation``.

    The executor keeps one per caller tensor it checked, and a placement one per output
    view it returns (``where`` is then the side written), so that an output given back
    as an input is known without asking TVM."""

    tensor: Any
    shape: tuple
    dtype: str
    small: bool | None = None
    generation: int = -1  # no pool generation: ``where`` not looked up yet
    where: int | str | None = None


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
    outputs: tuple[tuple[int, ViewAt, Any], ...]  # (position, the view, the pool's value)
    moving: tuple[int, ...]
    caller: tuple
    guards: list  # (condition, expect); a condition read from an input is filled per call
    guard_inputs: tuple[tuple[int, int], ...]  # (guard index, input index)
    redirected: bool = False  # an output position holds a caller's out= tensor


@dataclass(eq=False)
class Placement:
    """A planned call placed on one side of the pool, for one pool generation: its launches'
    arguments, its outputs (pool views; None where an input is passed through), and
    ``described``: the facts of those views by ``id`` (their side as ``where``), so that
    an output given back as an input is known without asking TVM."""

    generation: int
    launches: list[LaunchArgs]
    outputs: list
    described: dict[int, TensorFacts]

    def release_inputs(self) -> None:
        """Drop the call's inputs from the argument lists (``PlannedCall.fill`` puts them
        there): a planned call kept for later dims must not keep a finished call's tensors
        alive (a host array copied per call, a cache of that length)."""
        for launch in self.launches:
            for position, _ in launch.inputs:
                launch.values[position] = None
            for position, *_ in launch.input_views:
                launch.values[position] = None
            for g, _ in launch.guard_inputs:
                launch.guards[g] = (None, launch.guards[g][1])


class _Caller:
    """The identity of a launch's argument layout over the pool (``LaunchArgs.caller``)."""

    __slots__ = ()


@dataclass(eq=False)
class _LaunchLayout:
    """What a launch's arguments are, by position: inputs filled per call, pool buffers and
    bound inputs (``fixed``), dims by value (``scalars``), and which may move."""

    inputs: list = field(default_factory=list)  # (position, input)
    input_views: list = field(default_factory=list)  # (position, input, shape, dtype)
    fixed: list = field(default_factory=list)  # (position, a bound input's index or a ViewAt)
    outputs: list = field(default_factory=list)  # (position, ViewAt) on an output storage
    scalars: list = field(default_factory=list)  # (position, value)
    guard_inputs: list = field(default_factory=list)  # (guard, input)
    moving: tuple = ()
    key: tuple = ()


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
        self._placed: dict[int, Placement] = {}  # per side
        self._layouts = [self._layout(launch) for launch in self.launches]
        # The executor's recording count when every launch was last known recorded.
        self.verified = -1
        # Outputs that are all pool views: the placed list is the call's outputs as it is.
        self._outputs_placed_as_is = all(
            a.kind == "view" and at.views[a.index].base == "storage" for a in at.outputs)

    @property
    def guarded(self) -> bool:
        return self.at.guarded

    def recorded(self, backend) -> bool:
        """Whether the backend holds a recording of every launch (one may be evicted)."""
        return all(backend.has(launch.region, launch.shape) for launch in self.launches)

    def _output_storage(self, index: int) -> int | None:
        """The storage output ``index`` alone is a view of (at offset 0), else None."""
        arg = self.at.outputs[index]
        if arg.kind != "view":
            return None
        view = self.at.views[arg.index]
        if view.base != "storage" or view.offset != 0:
            return None
        sharing = [a for a in self.at.outputs if a.kind == "view" and
                   self.at.views[a.index][:2] == ("storage", view.index)]
        return view.index if len(sharing) == 1 else None

    def output_spec(self, index: int) -> tuple[tuple, str] | None:
        """(shape, dtype) of output ``index`` if a caller's tensor can stand in for its
        storage (``out=``), else None."""
        if self._output_storage(index) is None:
            return None
        view = self.at.views[self.at.outputs[index].index]
        return view.shape, view.dtype

    def redirect(self, out: dict[int, Any]) -> dict[int, Any]:
        """``out`` (output index -> tensor) by the storage each stands in for."""
        return {self._output_storage(i): target for i, target in out.items()}

    # -- placing on the pool ---------------------------------------------------------------
    def placed(self, pool: BufferPool, side: int, addresses_only: bool) -> Placement:
        """This call on ``side``: made once per pool generation and side."""
        found = self._placed.get(side)
        if found is None or found.generation != pool.generation:
            found = self._placed[side] = self._place(pool, side, addresses_only)
        return found

    def _side(self, storage: int, side: int) -> int:
        return side if storage in self.output_storages else 0

    def _pool_value(self, view: ViewAt, pool: BufferPool, side: int, addresses_only: bool):
        return pool.value(view, self._side(view.index, side), addresses_only)

    def _layout(self, launch: Launch) -> _LaunchLayout:
        layout = _LaunchLayout()
        key = []
        for position, arg in enumerate(launch.args):
            if arg.kind == "input" and arg.index in self.bound:
                layout.fixed.append((position, arg.index))
                key.append(("bound", arg.index))
            elif arg.kind == "input":
                layout.inputs.append((position, arg.index))
                key.append("input")
            elif arg.kind in ("value", "shape"):
                # A dim by value differs between dims: no address, set per planned call.
                layout.scalars.append((position, arg.value if arg.kind == "value" else
                                       tvm_ffi.Shape(arg.value)))
                key.append(arg.kind)
            else:
                view = self.at.views[arg.index]
                if view.base == "input":
                    layout.input_views.append((position, view.index, view.shape, view.dtype))
                    key.append("input")
                    continue
                layout.fixed.append((position, view))
                output = view.index in self.output_storages
                if output:
                    layout.outputs.append((position, view))
                key.append(("output" if output else "buffer", view.index, view.offset))
        layout.key = tuple(key)
        for g, (condition, expect) in enumerate(launch.guards):
            if condition.kind == "input" or self.at.views[condition.index].base == "input":
                index = condition.index if condition.kind == "input" else \
                    self.at.views[condition.index].index
                layout.guard_inputs.append((g, index))
        layout.moving = tuple(p for p, _ in layout.inputs) + \
            tuple(p for p, *_ in layout.input_views) + tuple(p for p, *_ in layout.outputs)
        return layout

    def _resolve(self, layout: _LaunchLayout, pool: BufferPool, side: int,
                 addresses_only: bool, size: int) -> list:
        """A launch's arguments that live in the pool or are bound, at their places."""
        values: list[Any] = [None] * size
        for position, fixed in layout.fixed:
            if isinstance(fixed, ViewAt):
                values[position] = self._pool_value(fixed, pool, side, addresses_only)
            else:  # a bound input's index
                tensor = self.bound[fixed]
                values[position] = Address(tensor.data_ptr()) if addresses_only else tensor
        return values

    def _place(self, pool: BufferPool, side: int, addresses_only: bool):
        launches = []
        for launch, layout in zip(self.launches, self._layouts):
            size = len(launch.args)
            if addresses_only:
                # Addresses do not depend on the dims: one list for every planned call with
                # this layout (a decode loop meets new dims on every step), copied.
                values = list(pool.shared(
                    ("args", launch.region, side, self.bound_version, layout.key),
                    lambda: self._resolve(layout, pool, side, True, size)))
            else:
                values = self._resolve(layout, pool, side, False, size)
            for position, value in layout.scalars:
                values[position] = value
            from_inputs = {g for g, _ in layout.guard_inputs}
            guards = [(None, expect) if i in from_inputs else
                      (self._pool_value(self.at.views[condition.index], pool, side,
                                        addresses_only), expect)
                      for i, (condition, expect) in enumerate(launch.guards)]
            outputs = tuple((position, view, values[position]) for position, view in layout.outputs)
            # One object for every launch of this region over the same buffers: the
            # backend compares callers by identity, and only ``moving`` differs between them.
            caller = pool.shared(("caller", launch.region, self.bound_version, layout.key),
                                 _Caller)
            launches.append(LaunchArgs(launch, values, tuple(layout.inputs),
                                       tuple(layout.input_views), outputs, layout.moving,
                                       caller, guards, tuple(layout.guard_inputs)))
        outputs = [None if a.kind == "input" else
                   tvm_ffi.Shape(a.value) if a.kind == "shape" else
                   # a value of the dims, int64 as TVM's shape values; made once a placement
                   scalar_tensor(a.value, "int64", pool.device) if a.kind == "value" else
                   self._output_view(a, pool, side) for a in self.at.outputs]
        described = {id(held): TensorFacts(held, view.shape, view.dtype,
                                           generation=pool.generation, where=side)
                     for a, held in zip(self.at.outputs, outputs) if a.kind == "view"
                     for view in (self.at.views[a.index],) if view.base == "storage"}
        return Placement(pool.generation, launches, outputs, described)

    def _output_view(self, arg: Arg, pool: BufferPool, side: int):
        view = self.at.views[arg.index]
        if view.base == "input":
            return None  # filled per call
        return self._pool_value(view, pool, side, addresses_only=False)

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
            for position, view, pool_value in launch.outputs:
                target = redirect.get(view.index) if redirect else None
                values[position] = pool_value if target is None else \
                    Address(target.data_ptr() + view.offset) if addresses_only else \
                    target._create_view(tvm_ffi.Shape(view.shape), view.dtype, view.offset)
            launch.redirected = bool(redirect)
        for g, index in launch.guard_inputs:
            launch.guards[g] = (inputs[index], launch.guards[g][1])

    def outputs(self, placed: list, inputs: Sequence[Any], out: dict[int, Any] | None) -> list:
        """The call's outputs: pool views, inputs passed through, the caller's ``out=``."""
        if not out and self._outputs_placed_as_is:
            return placed
        results = []
        for i, (arg, held) in enumerate(zip(self.at.outputs, placed)):
            if out and i in out:
                results.append(out[i])
            elif arg.kind == "input":
                results.append(inputs[arg.index])
            elif held is None:  # a view of an input
                view = self.at.views[arg.index]
                results.append(inputs[view.index]._create_view(tvm_ffi.Shape(view.shape),
                                                               view.dtype))
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
                view = self.at.views[arg.index]
                shape = tvm_ffi.Shape(view.shape)
                if view.base == "input":
                    args.append(inputs[view.index]._create_view(shape, view.dtype))
                elif redirect and view.index in redirect:
                    args.append(redirect[view.index]._create_view(shape, view.dtype, view.offset))
                else:
                    args.append(pool.view(view.index, view.offset, view.shape, view.dtype,
                                          self._side(view.index, side)))
        return args

    def guards_as_tensors(self, launch: Launch, inputs: Sequence[Any], pool: BufferPool,
                          side: int) -> list[tuple[Any, bool]]:
        """``launch``'s guards with their conditions as tensors or addresses."""
        def condition(arg: Arg):
            if arg.kind == "input":
                return inputs[arg.index]
            view = self.at.views[arg.index]
            return inputs[view.index] if view.base == "input" else \
                self._pool_value(view, pool, side, addresses_only=False)

        return [(condition(c), e) for c, e in launch.guards]
