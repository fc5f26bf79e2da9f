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

import bisect
from dataclasses import dataclass
from typing import Any, Sequence

import tvm
import tvm_ffi

from .signature import nbytes

MEMO_LIMIT = 1 << 16  # entries of the pool's shared caches before they start over
# Guards per region call: the conditionals a region may nest in; a call nested deeper keeps
# the VM. The patch kernel's launch record has room for this many (topology_graph).
MAX_GUARDS = 8


@dataclass(frozen=True)
class Slot:
    """Where a region argument or an output comes from on a planned call."""

    kind: str  # "input" (index into the call's inputs), "buffer" (pool buffer) or "value"
    index: int = 0
    shape: tuple = ()
    dtype: str = ""
    value: Any = None


class Address(int):
    """A device address standing in for a tensor where a backend reads only addresses
    (CUDA graphs): far cheaper to make than a tensor view, and made once per plan."""

    def data_ptr(self) -> int:
        return int(self)


class BufferPool:
    """Executor-owned device buffers, one per slot, grown to the largest size asked for.

    Slots that hold a call's outputs have two sides: a call writes its outputs on the side
    its inputs do not live on, so that the outputs of one call fed to the next (a decode
    loop's KV cache) are read in place while the new ones are written beside them.
    """

    def __init__(self, device: tvm.runtime.Device):
        self.device = device
        self.buffers: list[list[Any]] = []  # per slot: [side 0] or [side 0, side 1]
        self.generation = 0  # bumped when a buffer moves: views made before are stale
        # What plans of every dims share, valid for one generation: region argument lists
        # (addresses do not depend on dims) and output views. A decode loop meets a new
        # past length, so a new plan, on every step: making these once is most of its cost.
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

    def view(self, index: int, shape: tuple, dtype: str, side: int = 0):
        base = self._buffer(index, side)
        ffi_shape = self._shapes.get(shape)
        if ffi_shape is None:  # building a Shape costs more than the view itself
            if len(self._shapes) > MEMO_LIMIT:
                self._shapes.clear()
            ffi_shape = self._shapes[shape] = tvm_ffi.Shape(shape)
        return base._create_view(ffi_shape, dtype)

    def _buffer(self, index: int, side: int):
        held = self.buffers[index]
        return held[side if side < len(held) else 0]

    def address(self, index: int, side: int = 0) -> "Address":
        """The buffer's address, made once per generation (plans of every dims share it)."""
        return self.shared(("address", index, side),
                           lambda: Address(self._buffer(index, side).data_ptr()))

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


class CallPlan:
    """The regions of one call at fixed dims, and where each argument and output lives.

    A region of a conditional region's branch comes with guards: its last slots are the
    conditions, ``expects`` what each must be for it to run. Both branches are in the
    plan; the backend decides on the device which runs (``GraphExecutor``'s branches).
    """

    def __init__(self, regions: list[tuple[str, tuple, list[Slot], tuple[bool, ...]]],
                 outputs: list[Slot]):
        self.regions = regions
        self.outputs = outputs
        self.output_buffers = {s.index for s in outputs if s.kind == "buffer"}
        self.guarded = any(expects for *_, expects in regions)
        self._generation: dict[int, int] = {}
        self._args: dict[int, list[tuple]] = {}  # per side
        self._outs: dict[int, list[Any]] = {}
        self._described: dict[int, dict[int, tuple]] = {}  # per side, see ``described``
        self._layouts = [self._layout(slots, len(slots) - len(expects))
                         for _, _, slots, expects in regions]

    def _layout(self, slots: list[Slot], num_args: int) -> tuple:
        """What a region call's argument list is made of, independent of the pool: the key
        its address list is shared under, the positions of inputs, of dims passed by value
        and of outputs, and the region arguments that may move between calls (guards,
        after ``num_args``, are written on every launch)."""
        def is_scalar(slot: Slot) -> bool:  # a dim passed by value: differs between dims
            return slot.kind == "value" and not isinstance(slot.value, tvm.runtime.Tensor)

        key = tuple((s.kind, "scalar" if is_scalar(s) else
                     id(s.value) if s.kind == "value" else s.index) for s in slots)
        inputs = [(i, s.index) for i, s in enumerate(slots) if s.kind == "input"]
        scalars = [(i, s.value) for i, s in enumerate(slots) if is_scalar(s)]
        outputs = {i: s.index for i, s in enumerate(slots)
                   if s.kind == "buffer" and s.index in self.output_buffers}
        shared = [i for i, s in enumerate(slots) if s.kind != "input" and not is_scalar(s)]
        moving = [i for i in [i for i, _ in inputs] + list(outputs) if i < num_args]
        return key, inputs, scalars, outputs, shared, moving, num_args

    def _buffer_side(self, slot: Slot, side: int) -> int:
        return side if slot.index in self.output_buffers else 0

    def _view(self, slot: Slot, pool: BufferPool, side: int):
        return pool.view(slot.index, slot.shape, slot.dtype, self._buffer_side(slot, side))

    def _materialize(self, pool: BufferPool, side: int, addresses_only: bool) -> None:
        # Made once per pool generation and side, not per call. A backend that reads only
        # addresses gets them for the buffers no caller sees; outputs are always views.
        def fixed(slot: Slot, returned: bool = False):
            if slot.kind != "buffer":
                return slot.value
            if addresses_only and not returned:
                return pool.address(slot.index, self._buffer_side(slot, side))
            if returned:
                return pool.shared(("view", slot.index, self._buffer_side(slot, side),
                                    slot.shape, slot.dtype),
                                   lambda: self._view(slot, pool, side))
            return self._view(slot, pool, side)

        def region_values(slots: list[Slot], shared: list[int]) -> list[Any]:
            values = [None] * len(slots)
            for i in shared:
                values[i] = fixed(slots[i])
            return values

        args = []
        for (region, shape, slots, expects), layout in zip(self.regions, self._layouts):
            key, inputs, scalars, outputs, shared, moving, num_args = layout
            if addresses_only:  # the same list for plans of any dims: share it
                values = pool.shared(("args", region, side, key),
                                     lambda slots=slots, shared=shared: region_values(slots, shared))
            else:
                values = region_values(slots, shared)
            # Calls of any dims whose region arguments sit in the same pool buffers share
            # this key: between them only the inputs and the output side move.
            caller = (pool.generation, region, key)
            args.append((region, shape, values, inputs, scalars, outputs, moving, caller,
                         num_args, expects))
        self._args[side] = args
        self._outs[side] = [None if s.kind == "input" else fixed(s, returned=True)
                            for s in self.outputs]
        self._described[side] = {id(view): (view, slot.shape, slot.dtype, side)
                                 for slot, view in zip(self.outputs, self._outs[side])
                                 if view is not None and slot.kind == "buffer"}
        self._generation[side] = pool.generation

    def described(self, side: int) -> dict[int, tuple]:
        """The output views a call on ``side`` returns, by ``id``: (view, shape, dtype, side).

        The plan holds the views, so an ``id`` names one of them for as long as it is here:
        an executor given one back as an input knows its shape and dtype without asking TVM
        (reading a TVM tensor's dtype builds an FFI object, and a decode step passes dozens).
        """
        return self._described.get(side, {})

    def calls(self, inputs: Sequence[Any], pool: BufferPool, side: int
              ) -> tuple[list[tuple[str, tuple, list[Any]]], list[Any]]:
        """Each region's call on ``inputs`` as tensors (pool views, inputs, values), and
        the outputs: what a caller re-issuing the call itself needs (a device loop's body)."""
        def value(slot: Slot):
            if slot.kind == "input":
                return inputs[slot.index]
            return self._view(slot, pool, side) if slot.kind == "buffer" else slot.value

        if self.guarded:
            raise NotImplementedError("this call has data-dependent branches (conditional "
                                      "regions): it cannot be re-issued region by region")
        regions = [(region, shape, [value(s) for s in slots])
                   for region, shape, slots, _ in self.regions]
        return regions, [value(s) for s in self.outputs]

    def run(self, inputs: Sequence[Any], pool: BufferPool, backend, side: int = 0,
            out: dict[int, Any] | None = None) -> list[Any] | None:
        """Launch every region; None (nothing launched) if one lost its recording.

        ``out`` maps an output's index to a tensor of the caller's that the graphs write
        into directly, in place of the pool's buffer.
        """
        if not all(backend.has(region, shape) for region, shape, *_ in self.regions):
            return None  # evicted by a bounded per-shape cache: the VM records it again
        if self._generation.get(side) != pool.generation:
            self._materialize(pool, side, getattr(backend, "addresses_only", False))
        redirect = {self.outputs[i].index: t for i, t in (out or {}).items()}
        for (region, shape, values, from_inputs, scalars, outputs, moving, caller, num_args,
             expects) in self._args[side]:
            args = list(values)
            for position, index in from_inputs:
                args[position] = inputs[index]
            for position, value in scalars:
                args[position] = value
            for position, index in outputs.items():
                if index in redirect:
                    args[position] = redirect[index]
            guards = list(zip(args[num_args:], expects)) if expects else ()
            backend.replay(region, shape, args[:num_args] if expects else args, caller, moving,
                           guards)
        results = []
        for i, (slot, held) in enumerate(zip(self.outputs, self._outs[side])):
            if out and i in out:
                results.append(out[i])
            else:
                results.append(inputs[slot.index] if slot.kind == "input" else held)
        return results


def guarded_calls(branches: dict, name: str, shape: tuple, args: Sequence[Any],
                  guards: tuple = ()) -> list[tuple[str, tuple, list, tuple]] | None:
    """The region calls of conditional region ``name`` called with ``args`` at ``shape``:
    ``(region, shape, arguments, guards)`` for both branches, a guard being ``(condition,
    expect)``; a nested conditional adds its own. None if a conditional is not described
    (``branches``, from ``DescribeConditionals``) or a region would need more than
    ``MAX_GUARDS`` guards."""
    described = branches.get(name)
    if described is None or len(guards) >= MAX_GUARDS:
        return None
    condition = args[described["condition"]]
    calls = []
    for expect, side in zip((True, False), described["branches"]):
        inner = guards + ((condition, expect),)
        for call in side:
            call_args = [args[i] for i in call["args"]]
            call_shape = tuple(shape[i] for i in call["dims"])
            if call["kind"] == "conditional":
                nested = guarded_calls(branches, call["callee"], call_shape, call_args, inner)
                if nested is None:
                    return None
                calls += nested
            else:
                calls.append((call["callee"], call_shape, call_args, inner))
    return calls


class CallPlanRecorder:
    """Watches one VM call's region calls and turns them into a ``CallPlan``, if it can.

    Inputs listed in ``fixed`` (bound once, such as weights) are kept as values: they do
    not move from call to call, so a replay need not look at their addresses.
    """

    def __init__(self, inputs: Sequence[Any], fixed: Sequence[int] = ()):
        self.inputs = list(inputs)
        self.fixed = set(fixed)
        # (region, shape, arguments then guard conditions, what each guard expects)
        self.calls: list[tuple[str, tuple, list[Any], tuple[bool, ...]]] = []
        self._depth = 0  # inside a conditional region's call: its regions are planned already
        self.unplannable = ""  # why no plan can be made, if so

    def on_region(self, region: str, shape: tuple, args: Sequence[Any]) -> None:
        if self._depth == 0:
            self.calls.append((region, shape, list(args), ()))

    def on_conditional(self, name: str, calls: list | None) -> None:
        """A conditional region's call: ``calls`` (``guarded_calls``), the regions of both
        its branches, each guarded by the condition (and by those it is nested in)."""
        if self._depth == 0:
            if calls is None:  # not described, or nested too deep: no plan, the VM runs it
                self.unplannable = f"conditional region {name} cannot be planned"
            else:
                self.calls += [(region, region_shape, region_args + [c for c, _ in guards],
                                tuple(e for _, e in guards))
                               for region, region_shape, region_args, guards in calls]
        self._depth += 1

    def end_conditional(self) -> None:
        self._depth -= 1

    def finish(self, outputs: Sequence[Any], pool: BufferPool,
               buffer_of: dict[tuple, int]) -> CallPlan | None:
        """The plan, or None when the call's memory cannot be re-created buffer by buffer.

        A tensor is named by where it first appears (region call, argument): the same name
        at every shape, so ``buffer_of`` (shared by all plans of an executor) gives it the
        same pool buffer at every shape, sized for the largest.
        """
        if self.unplannable:
            return None
        seen: dict[int, tuple[int, int]] = {}  # address -> (slot, nbytes)
        position = [0, 0]

        def slot(t) -> Slot | None:
            if not isinstance(t, tvm.runtime.Tensor):
                return Slot("value", value=t)
            for i, x in enumerate(self.inputs):
                if x.data_ptr() == t.data_ptr() and tuple(x.shape) == tuple(t.shape):
                    return Slot("value", value=x) if i in self.fixed else Slot("input", i)
            address, size_here = t.data_ptr(), nbytes(t)
            for other, (_, size) in seen.items():
                if other != address and other < address + size_here and address < other + size:
                    return None  # overlapping views of one storage: keep the VM
            if address in seen:
                index = seen[address][0]
            else:
                index = buffer_of.setdefault(tuple(position), len(buffer_of))
            seen[address] = (index, max(size_here, seen.get(address, (0, 0))[1]))
            return Slot("buffer", index, tuple(t.shape), str(t.dtype))

        regions = []
        for call, (region, shape, args, expects) in enumerate(self.calls):
            slots = []
            for arg, value in enumerate(args):
                position[:] = [call, arg]
                slots.append(slot(value))
            if any(s is None for s in slots):
                return None
            regions.append((region, shape, slots, expects))
        out_slots = []
        for i, value in enumerate(outputs):
            position[:] = [-1, i]
            out_slots.append(slot(value))
        if any(s is None or s.kind == "value" for s in out_slots):
            return None
        outputs = {s.index for s in out_slots if s.kind == "buffer"}
        for index, size in seen.values():
            pool.reserve(index, size, sides=2 if index in outputs else 1)
        return CallPlan(regions, out_slots)
