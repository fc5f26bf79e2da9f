"""``GraphExecutor``: a call as the compiler's call program, regions through recorded graphs."""

from __future__ import annotations

import bisect
import ctypes
import itertools
import math
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm.runtime.vm import VirtualMachine, VMInstrumentReturnKind

from .backend import RegionBackend
from .call_plan import BufferPool, Placement, PlannedCall, TensorFacts, free_side, scalar_tensor
from .call_program import CONDITIONAL_PREFIX, REGION_PREFIX, CallProgram, Launch, guarded_calls
from .progress import Progress
from .signature import BoundDims, InputError, Signature, nbytes, nbytes_of

# TVM's kernels assume buffers aligned this far (tvm.runtime.from_dlpack's requirement).
ALIGNMENT = 64
# Shapes (dims) an executor keeps plans and recordings for, least recently used given up
# first: a few KiB of host memory each (bench/memory.py).
DEFAULT_MAX_SHAPES = 2048
# TVM's VM keeps every buffer it frees in a pool keyed by exact size, for ever: each new
# shape leaves its outputs there. The executor empties the pool once VM calls at dims it
# had not seen have returned this many bytes, or this many times (planned calls do not use
# the VM's memory at all).
# On the CPU the pool is host memory (bench/memory.py). On a GPU emptying it frees device
# buffers (cudaFree, a device-wide sync each) that the next VM call allocates again: below
# one call's outputs it would be paid on every call (a test recording 120 shapes of a
# 16 MiB output took minutes on the H200).
VM_POOL_CLEAR_BYTES = {"cpu": 4 << 20, "gpu": 256 << 20}
VM_POOL_CLEAR_CALLS = 64
# Caller tensors whose checks are remembered beyond the last call's, and how large each may
# be (a reference to each is held until it is pushed out, so at most 8 x 4 MiB are kept
# alive for the caller): a caller that keeps a static input tensor per shape, or a few it
# rotates, is checked once per tensor, not once per call. Reading a new tensor's dtype
# alone costs about a microsecond. The input sets of those tensors (up to RECENT_TENSORS
# + 1) are remembered whole: passed again, the call's arguments and dims are found at once.
RECENT_TENSORS = 8
RECENT_TENSOR_BYTES = 4 << 20


HOST_PHASES = ("checks", "plan", "record", "driver", "vm")


@dataclass
class CallStats:
    """What the executor did, summed over calls (``last`` holds the last call's figures).

    ``host_us`` splits the host time of calls by phase: ``checks`` (inputs checked, dims
    looked up), ``plan`` (the planned call found, the output side chosen, arguments
    filled), ``record`` (launch records written, recordings made at new shapes), ``driver``
    (the CUDA driver's copy and launch calls of replays), ``vm`` (calls TVM's VM ran).
    """

    calls: int = 0
    region_replays: int = 0
    region_recordings: int = 0
    planned_calls: int = 0  # calls that ran without the VM
    ready_calls: int = 0  # of those, made again as an earlier call with the same inputs was
    h2d_bytes: int = 0  # host arrays copied to the device (numpy inputs)
    d2h_bytes: int = 0  # outputs copied back to numpy
    d2d_bytes: int = 0  # device copies the executor made (out= the VM ran or overlapping an input)
    graph_launches: int = 0
    host_branch_reads: int = 0  # conditional regions the VM ran, reading the condition
    unrecorded_calls: int = 0  # VM calls not recorded: their inputs share memory
    evicted_shapes: int = 0  # dims whose plan was given up (max_shapes)
    # Held now (not summed): plans of dims, and (region, shape) recordings of the backend.
    plans_held: int = 0
    shapes_held: int = 0
    host_ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(HOST_PHASES, 0))
    # The last call's figures as they come: a call sets a few fields, and ``last`` makes its
    # dict only when read (a dict made and filled per call cost a microsecond of the hot
    # path). ``_last_added``: what ``add`` counted since the call began.
    _last_path: str | None = field(default=None, init=False, repr=False)  # None: no call yet
    _last_launches: int = field(default=0, init=False, repr=False)
    _last_phases: dict[str, int] | None = field(default=None, init=False, repr=False)
    _last_added: dict[str, int] = field(default_factory=dict, init=False, repr=False)

    def begin_call(self) -> None:
        self._last_path, self._last_launches, self._last_phases = "vm", 0, None
        if self._last_added:
            self._last_added = {}

    def add(self, key: str, value: int) -> None:
        self._last_added[key] = self._last_added.get(key, 0) + value
        setattr(self, key, getattr(self, key) + value)

    def end_call(self, launches: int, phases: dict[str, int]) -> None:
        """One call's graph launches and host time per phase (nanoseconds); a call with a
        "vm" phase ran on TVM's VM, any other ran its plan."""
        self.calls += 1
        self.graph_launches += launches
        self._last_launches, self._last_phases = launches, phases
        self._last_path = "vm" if "vm" in phases else "planned"
        totals = self.host_ns
        for phase, ns in phases.items():
            totals[phase] += ns

    @property
    def last(self) -> dict[str, Any]:
        """The last call's figures: bytes copied (``h2d_bytes``, ``d2h_bytes``,
        ``d2d_bytes``), ``graph_launches``, ``path`` ("planned" or "vm"), host time per
        phase (``host_ns``, once the call returned) and whatever else it counted; empty
        before the first call."""
        if self._last_path is None:
            return {}
        last = {"h2d_bytes": 0, "d2h_bytes": 0, "d2d_bytes": 0,
                "graph_launches": self._last_launches, "path": self._last_path}
        last.update(self._last_added)
        if self._last_phases is not None:
            last["host_ns"] = self._last_phases
        return last

    @property
    def host_us(self) -> dict[str, float]:
        """Host time of every call so far, per phase, in microseconds."""
        return {phase: ns / 1e3 for phase, ns in self.host_ns.items()}

    @property
    def last_host_us(self) -> dict[str, float]:
        """The last call's host time per phase, in microseconds."""
        return {phase: ns / 1e3 for phase, ns in (self._last_phases or {}).items()}


@dataclass
class _Recording:
    """A region being recorded: by the VM's own call of it (``run`` by the VM), or issued
    by the executor (``run`` False: recorded without its effects)."""

    region: str
    recorder: Any
    run: bool
    by_vm: bool = False  # the VM's call of the region: ended when that call returns


@dataclass(eq=False, slots=True)
class _ReadyCall:
    """A planned call made again with the very inputs of the call that left it: its plan,
    side and placement as that call found them, and per launch what the backend keeps to
    make it again (``RegionBackend.ready``; None: replayed from its argument list). Valid
    while the pool keeps its generation and the backend records nothing new (which may
    evict or move a recording): ``epoch`` is ``CallStats.region_recordings`` then."""

    planned: PlannedCall
    side: int
    placement: Placement
    # Per launch of ``placement``: the backend's ready launch, or None (replayed).
    launches: tuple[Callable[[], None] | None, ...]
    outputs: list  # ``PlannedCall.outputs`` of that call
    epoch: int
    # Whether a launch is replayed from its argument list (which must hold the inputs).
    replays_arguments: bool = field(init=False)

    def __post_init__(self):
        self.replays_arguments = None in self.launches


@dataclass(eq=False, slots=True)
class _Prepared:
    """A call's inputs (``items``: the mapping's (name, value) pairs) and what checking
    them gave: the entry function's arguments, the dims key, the facts of the tensors
    passed, and those facts by the tensors' ``id`` (``checked``). ``reusable``: every
    value is a TVM tensor read in place, so that passed again as they are, they are not
    checked again (``first``, the first value, is what the executor finds them by) and the
    call can be made again as it was (``ready``)."""

    items: tuple
    args: list
    key: tuple | None
    passed: Sequence[TensorFacts]
    checked: dict[int, TensorFacts]
    reusable: bool = True
    repeated: bool = False  # passed again since: worth keeping ``ready`` for
    ready: _ReadyCall | None = None
    first: Any = field(init=False)  # the first value: what the input set is found by

    def __post_init__(self):
        self.first = self.items[0][1] if self.items else None

    def passed_as(self, inputs: Mapping[str, Any]) -> bool:
        """Whether ``inputs`` are these very values under these names."""
        if len(inputs) != len(self.items):
            return False
        for name, value in self.items:  # a loop: all() over a generator costs a microsecond
            if inputs.get(name) is not value:
                return False
        return True


class GraphExecutor:
    """Run a grape-compiled module on one device.

    With a call program (``CallProgram``, written by the compiler for a model without host
    steps) a call runs no VM: the program, evaluated once per dims (``PlannedCall``), gives
    every region launch and its arguments on buffers the executor owns; the backend replays
    each region's recording at its shape (one graph launch on CUDA), recording it first at
    a shape it has not seen, the VM issuing the region function while the backend records.
    A conditional region's two branches are both launched, each guarded by the condition,
    which the backend checks on the device: no host read.

    Without a program (host steps, or an executable straight from ``tvm.compile``) the
    entry function runs on TVM's VM, and each region call is intercepted: replayed if
    recorded at its shape, else recorded as the VM runs it. A conditional region whose
    branches are all recorded is launched guarded; else the VM runs it (reading the
    condition: ``stats.host_branch_reads``).

    A recording maps kernel arguments to the call's tensors by address, so a call whose
    inputs share memory (one tensor passed for two inputs, overlapping views) is run by the
    VM without being recorded: it could not stand for calls on separate tensors.

    The executor keeps plans and recordings for at most ``max_shapes`` dims (least recently
    used given up first, recorded again if they come back). It owns its VM, its backend
    (streams, graphs) and its buffers; ``close()`` frees them, and so does dropping the
    executor. Calls are serialized by a lock; use one executor per thread for parallel
    calls.
    """

    def __init__(self, executable: tvm.runtime.Module, device: tvm.runtime.Device,
                 signature: Signature | None = None, backend: RegionBackend | None = None,
                 entry: str = "main", program: CallProgram | None = None,
                 branches: Mapping[str, dict] | None = None,
                 max_shapes: int = DEFAULT_MAX_SHAPES, transposed_inputs: Collection[str] = ()):
        if max_shapes < 1:
            raise ValueError(f"max_shapes must be at least 1, got {max_shapes}")
        self.device = device
        self.program = program if signature is not None else None
        self.branches = dict(branches if branches is not None else
                             program.conditionals if program is not None else {})
        self.signature = signature
        self.max_shapes = max_shapes
        self.backend: RegionBackend = backend if backend is not None else \
            default_backend(device, max_shapes)
        self.entry = entry
        self.stats = CallStats()
        self._vm = VirtualMachine(executable, device)
        # The VM keeps its instrument alive, and the executor its VM: a strong reference
        # back would make a cycle through TVM's FFI that Python's collector cannot see.
        self._vm.set_instrument(_weakly_bound(self._instrument))
        self._open: _Recording | None = None
        self._recording = True  # False during a VM call whose inputs share memory
        # Regions of conditional regions the VM ran during this call (``_on_conditional``).
        self._branches_to_record: list[tuple[str, tuple, list, tuple]] = []
        self._lock = threading.Lock()
        # Dims seen, least recently used first: their planned call, or None (the VM runs it).
        self._plans: OrderedDict[tuple, PlannedCall | None] = OrderedDict()
        # VM calls at new dims since the VM's memory pool was emptied, and their outputs' bytes.
        self._vm_pool_calls = self._vm_pool_bytes = 0
        self._on_cpu = _on_host(device)
        self._vm_pool_limit = VM_POOL_CLEAR_BYTES["cpu" if self._on_cpu else "gpu"]
        self._pool = BufferPool(device)
        self._bound: dict[str, tvm.runtime.Tensor] = {}
        self._bound_dims = BoundDims()
        self._bound_spans = _Spans(())  # their memory, for out= tensors overlapping them
        # 2-D inputs the entry takes transposed (the plan's ``transposed_inputs``): made so
        # once, by ``bind_inputs``; ``run`` refuses them.
        self.transposed_inputs = frozenset(transposed_inputs)
        self.bound_version = 0  # bumped by bind_inputs: graphs holding bound addresses are stale
        inputs = signature.inputs if signature is not None else ()
        self._position = {t.name: i for i, t in enumerate(inputs)}
        self._output_names = [t.name for t in signature.outputs] if signature is not None else []
        # A model whose one output is a sequence returns it as a tuple: one output.
        self._one_sequence = _one_sequence(signature)
        self._template: list[Any] = [None] * len(inputs)  # bound inputs in place
        # Fast paths of a call's checks: the last planned call's outputs (an autoregressive
        # caller passes them straight back) and the dims of input shapes seen before.
        self._returned: dict[int, TensorFacts] = {}
        # Caller tensors checked, by id: the last call's (``_checked``) and up to
        # RECENT_TENSORS small ones of calls before, least recently passed first
        # (``_recent``).
        self._checked: dict[int, TensorFacts] = {}
        self._recent: dict[int, TensorFacts] = {}
        self._last_prepared: _Prepared | None = None  # the last call's inputs, what they gave
        # Input sets of small caller tensors checked before, by the id of their first
        # value, oldest first: a caller rotating a few static inputs (one per shape) finds
        # its call prepared, with no check, no dims lookup and no list made. Every tensor
        # in them is in ``_checked`` or ``_recent`` (``_forget``): they keep nothing more
        # alive than those.
        self._prepared: dict[int, _Prepared] = {}
        self._filled: Placement | None = None  # the placement holding the last call's inputs
        self._filled_by: _Prepared | None = None  # whose inputs they are (None: unknown)
        # A call passing the very tensors of an earlier one is made again from what that
        # call kept (``_ReadyCall``). Off: every call plans and writes its launch records
        # (bench/argument_tables.py measures both in one run).
        self.keep_ready_calls = True
        self._dims_of: dict[tuple, tuple] = {}

    # -- calls ---------------------------------------------------------------------------
    def bind_inputs(self, inputs: Mapping[str, Any]) -> None:
        """Fix inputs that do not change from call to call (weights): checked and moved to
        the device once, then left out of ``run``'s inputs. A host array is copied (changing
        it later changes nothing); a device or DLPack tensor (a torch tensor) is read where
        it is, so that changing it in place changes the calls after (unless misaligned, or a
        weight this build reads transposed: then copied too)."""
        if self.signature is None:
            raise ValueError("bind_inputs needs the model's signature (load it from an artifact)")
        with self._lock:
            self._check_open()
            specs = {t.name for t in self.signature.inputs}
            unknown = sorted(set(inputs) - specs)
            if unknown:
                raise InputError(f"unknown input(s) {unknown}: the model takes {sorted(specs)}")
            # A weight the build reads transposed is checked as the model declares it.
            given = {name: self._transposed_host(name, value)
                     if name in self.transposed_inputs else self._as_tensor(name, value)
                     for name, value in inputs.items()}
            bound_dims = self._bound_dims.binding(
                self.signature, {k: tuple(t.shape) for k, t in given.items()},
                {k: str(t.dtype) for k, t in given.items()})
            tensors = {k: self._as_tensor(k, np.ascontiguousarray(t.T))
                       if k in self.transposed_inputs else t for k, t in given.items()}
            self._bound_dims = bound_dims
            self._bound.update(tensors)
            self._bound_spans = _Spans(self._bound.values())
            self._template = [self._bound.get(t.name) for t in self.signature.inputs]
            self._plans.clear()
            self._returned, self._checked, self._recent, self._dims_of = {}, {}, {}, {}
            self._prepared = {}
            self._last_prepared = self._filled = self._filled_by = None
            self.bound_version += 1

    @property
    def bound_names(self) -> frozenset[str]:
        """Names of the inputs bound with ``bind_inputs``."""
        return frozenset(self._bound)

    def device_tensor(self, name: str, value: Any) -> tvm.runtime.Tensor:
        """``value`` as a tensor on this executor's device: a device tensor as it is (checked:
        device, layout), a host array copied (counted in ``stats``)."""
        return self._as_tensor(name, value)

    def run(self, inputs: Mapping[str, Any] | Sequence[Any], *, return_numpy: bool = True,
            out: Mapping[str, Any] | None = None) -> dict[str, Any] | list[Any]:
        """Run one call; ``inputs`` maps input names to numpy arrays or DLPack tensors.

        Device tensors are read where they are: no copy. Returned tensors
        (``return_numpy=False``) belong to the executor and stay valid until a later call
        writes them: the next call, or the one after it when the next call's inputs are
        this call's outputs (a decode loop feeding its cache back; see ``BufferPool``).
        ``out`` maps output names to device tensors of the caller's, written directly; one
        that overlaps an input (bound ones included), or for an output no kernel writes (an
        input passed through), is written after the call, by a copy (counted in
        ``stats.d2d_bytes``). Two outputs may not share a tensor.
        Without a signature (an executable straight from ``tvm.compile``) inputs are
        positional and outputs come back as a list. ``stats`` counts copies, launches and
        host time. The executor keeps a reference to the TVM tensors of the last call and to
        ``RECENT_TENSORS`` (8) small ones (up to 4 MiB each) of calls before: passed again,
        they are not checked again.
        """
        with self._lock:
            self._check_open()
            stats = self.stats
            stats.begin_call()
            start = time.perf_counter_ns()
            prepared = self._prepare(inputs)
            targets = self._prepare_out(out) if out else _NO_TARGETS
            checked = time.perf_counter_ns()
            phases = {"checks": checked - start}
            launches = self.backend.launches
            try:
                ready = prepared.ready
                # Made again as it was while nothing it stands on moved: the pool's buffers
                # (its generation) and the backend's recordings (none made since).
                if ready is not None and not targets and self.keep_ready_calls and \
                        ready.placement.generation == self._pool.generation and \
                        ready.epoch == stats.region_recordings:
                    outputs = self._run_ready(prepared, ready, phases, checked)
                else:
                    outputs = self._call(prepared, targets, phases, checked)
                if return_numpy:
                    with self.backend.stream_context():
                        outputs = _to_numpy(outputs)
                    stats.add("d2h_bytes", _bytes(outputs))
            except BaseException:
                self._abandon_recording()
                raise
            stats.end_call(self.backend.launches - launches, phases)
            return outputs

    __call__ = run

    def _prepare_out(self, out: Mapping[str, Any] | None) -> dict[int, Any]:
        if not out:
            return {}
        if self.signature is None:
            raise ValueError("out= needs the model's signature (load it from an artifact)")
        names = [t.name for t in self.signature.outputs]
        unknown = sorted(set(out) - set(names))
        if unknown:
            raise InputError(f"out names unknown output(s) {unknown}: the model returns {names}")
        targets = {}
        for name, value in out.items():
            if not isinstance(value, tvm.runtime.Tensor) and not hasattr(value, "__dlpack__"):
                raise TypeError(f"out[{name!r}] must be a device tensor (TVM or DLPack)")
            if self.signature.outputs[names.index(name)].kind == "sequence":
                raise InputError(f"output {name!r} is a sequence of tensors: it cannot be "
                                 "written to out=")
            targets[names.index(name)] = self._as_tensor(f"out[{name!r}]", value, copy=False)
        if len(targets) > 1 and _share_memory(list(targets.values())):
            raise InputError(f"out gives outputs {sorted(out)} tensors that share memory: each "
                             "output needs a tensor of its own")
        return targets

    def _call(self, prepared: _Prepared, out: dict[int, Any], phases: dict[str, int],
              start: int):
        planned = self._planned(prepared.key, prepared.args)
        if out and self._written_after(prepared, planned, out):
            # A copy of the list: a planned call's may be kept by its ready call.
            values = list(self._call_values(prepared, planned, _NO_TARGETS, phases, start))
            self._copy_out(values, out)
        else:
            values = self._call_values(prepared, planned, out, phases, start)
        return self._name_outputs(values)

    def _call_values(self, prepared: _Prepared, planned: PlannedCall | None,
                     out: dict[int, Any], phases: dict[str, int], start: int) -> list:
        """The call's output values, by its plan, or by TVM's VM where it has none."""
        if not out and self.keep_ready_calls:
            # Outdated, or the calls made again were off: made anew below if this call keeps
            # one. (An out= call leaves it: it stays valid, the lists it used are filled again.)
            prepared.ready = None
        if planned is not None:
            side = self._output_side(prepared.passed, out)
            if side is not None:
                if out:
                    self._check_out(out, planned)
                outputs = self._run_planned(planned, prepared, side, out, phases, start)
                if outputs is not None:
                    return self._planned_values(outputs)
        self._returned = {}
        values = self._call_vm(prepared.args, prepared.key, out)
        phases["vm"] = time.perf_counter_ns() - start
        return values

    def _written_after(self, prepared: _Prepared, planned: PlannedCall | None,
                       out: dict[int, Any]) -> bool:
        """Whether ``out``'s tensors are written after the call, by a copy: one overlaps an
        input (a kernel would read what it writes, and a region recorded writing into an
        input would write there at every replay), or an output is no kernel's own (an
        input passed through, a buffer another output shares)."""
        if any(self._overlaps_an_input(target, prepared) for target in out.values()):
            return True
        return planned is not None and any(planned.output_spec(i) is None for i in out)

    def _overlaps_an_input(self, tensor: tvm.runtime.Tensor, prepared: _Prepared) -> bool:
        """Whether ``tensor``'s memory overlaps one of the call's inputs, passed or bound
        (the bound ones' spans kept since they were bound: a model's weights are many)."""
        start = tensor.data_ptr()
        end = start + nbytes(tensor)
        if start == end:
            return False
        for facts in prepared.passed:
            other = facts.tensor.data_ptr()
            if start < other + nbytes_of(facts.shape, facts.dtype) and other < end:
                return True
        return self._bound_spans.overlaps(start, end)

    def _planned(self, key: tuple | None, args: list) -> PlannedCall | None:
        """The planned call at ``key``'s dims, made from the program the first time."""
        if self.program is None or key is None:
            return None
        planned = self._plans.get(key, _UNSEEN)
        if planned is not _UNSEEN:
            self._plans.move_to_end(key)
            return planned
        at = self.program.at(self.program.dims_of([tuple(a.shape) for a in args]))
        bound = {i: t for i, t in enumerate(self._template) if t is not None}
        planned = None if at is None else PlannedCall(at, self.program.output_storages, self._pool,
                                                      bound, self.bound_version)
        self._remember(key, planned)
        if at is not None:
            self._after_new_dims(sum(at.storage_bytes[i] for i in self.program.output_storages))
        return planned

    def _after_new_dims(self, output_bytes: int) -> None:
        """A call at dims not seen before leaves memory of its size behind: TVM's VM pools
        the buffers it frees (VM path), and the host heap keeps the freed host arrays and
        outputs of every size (either path). Emptied, and the heap trimmed, every
        ``VM_POOL_CLEAR_CALLS`` such calls or ``VM_POOL_CLEAR_BYTES`` of their outputs."""
        self._vm_pool_calls += 1
        self._vm_pool_bytes += output_bytes
        if self._vm_pool_calls >= VM_POOL_CLEAR_CALLS or \
                self._vm_pool_bytes >= self._vm_pool_limit:
            _clear_vm_memory_pools(trim_host=self._on_cpu)
            self._vm_pool_calls = self._vm_pool_bytes = 0

    def _output_side(self, passed: Sequence[TensorFacts], out: dict[int, Any]) -> int | None:
        """The pool side this call writes its outputs on, the one no input lives on
        (``free_side``): where each input lives is in its facts (our own outputs passed
        back: the side they were written on), looked up by address once per pool
        generation. Most calls' inputs live outside the pool: no set is made for them."""
        pool = self._pool
        taken = None
        for facts in passed:
            where = pool.locate(facts)
            if where is not None:
                taken = {where} if taken is None else taken | {where}
        if out:
            taken = (taken or set()) | {pool.where(tensor) for tensor in out.values()}
        return 0 if taken is None else free_side(taken)

    def _planned_values(self, outputs: list) -> list:
        """A planned call's outputs as the entry's values: one sequence is one value."""
        return [list(outputs)] if self._one_sequence else outputs

    def _run_planned(self, planned: PlannedCall, prepared: _Prepared, side: int,
                     out: dict[int, Any], phases: dict[str, int], start: int) -> list | None:
        """Launch every region of ``planned``; None if the VM must run this call instead.
        A call that can be made again as it was (``_Prepared.reusable``, no ``out=``) and
        repeats an earlier one's inputs keeps what that takes in ``prepared.ready`` if it
        recorded nothing (a decode step's inputs, new each step, keep nothing)."""
        backend, stats = self.backend, self.stats
        addresses_only = backend.addresses_only
        args = prepared.args
        epoch = stats.region_recordings
        if planned.verified != epoch and not planned.recorded(backend):
            if not self._record_guarded(planned, prepared.key, args, side):
                return None
        placement = planned.placed(self._pool, side, addresses_only)
        self._hold_inputs_in(placement)
        self._filled_by = None  # filled below: until the call is done, no one's inputs
        redirect = planned.redirect(out) if out else None
        keep = self.keep_ready_calls and prepared.reusable and prepared.repeated and not out
        ready_launches = []
        driver = backend.driver_ns
        launched = time.perf_counter_ns()
        replays = 0
        for launch in placement.launches:
            planned.fill(launch, args, redirect, addresses_only)
            spec = launch.launch
            if backend.replay(spec.region, spec.shape, launch.values, launch.caller,
                              launch.moving, launch.guards):
                replays += 1
                if keep:  # right after the replay it makes again
                    ready_launches.append(backend.ready(spec.region, spec.shape))
            else:
                self._record_launch(planned, spec, args, side, redirect)
                keep = False  # a recording may evict or move the rows replayed before it
        end = time.perf_counter_ns()
        if prepared.reusable and not out:  # the lists hold the tensors of a set kept
            self._filled_by = prepared
        self._planned_call_done(placement, phases, start, launched, end,
                                backend.driver_ns - driver, replays, out)
        if stats.region_recordings == epoch:  # none made now, so none evicted
            planned.verified = epoch
        outputs = planned.outputs(placement.outputs, args, out)
        if keep and stats.region_recordings == epoch:
            prepared.ready = _ReadyCall(planned, side, placement, tuple(ready_launches),
                                        outputs, epoch)
        return outputs

    def _run_ready(self, prepared: _Prepared, ready: _ReadyCall, phases: dict[str, int],
                   start: int):
        """Make a call again as ``ready`` says: no plan looked up, no side chosen, no
        argument written unless a launch is replayed from its argument list (the CPU
        replay, per-shape graphs, guarded launches)."""
        backend, placement = self.backend, ready.placement
        if ready.replays_arguments:
            self._fill_ready(prepared, ready)
        elif self._filled is not None:  # no argument list holds this call's inputs
            self._hold_inputs_in(None)
        try:  # least recently used last, as a planned call's dims would be
            self._plans.move_to_end(prepared.key)
        except KeyError:  # given up (``max_shapes``): the backend's recordings are still held
            pass
        driver = backend.driver_ns
        launched = time.perf_counter_ns()
        for launch, again in zip(placement.launches, ready.launches, strict=True):
            if again is not None:
                again()
                continue
            spec = launch.launch
            if not backend.replay(spec.region, spec.shape, launch.values, launch.caller,
                                  launch.moving, launch.guards):
                # A recording is given up only for one made after it, which outdates this.
                raise RuntimeError(f"{spec.region} at {spec.shape} is not recorded any more, "
                                   "yet nothing was recorded since the call that kept it")
        end = time.perf_counter_ns()
        self._planned_call_done(placement, phases, start, launched, end,
                                backend.driver_ns - driver, len(ready.launches), None)
        self.stats.ready_calls += 1
        return self._name_outputs(self._planned_values(ready.outputs))

    def _fill_ready(self, prepared: _Prepared, ready: _ReadyCall) -> None:
        """Put ``prepared``'s inputs into the argument lists of ``ready``'s placement,
        unless they hold them already."""
        self._hold_inputs_in(ready.placement)
        if self._filled_by is not prepared:
            for launch in ready.placement.launches:
                ready.planned.fill(launch, prepared.args, None, self.backend.addresses_only)
            self._filled_by = prepared

    def _planned_call_done(self, placement: Placement, phases: dict[str, int], start: int,
                           launched: int, end: int, driver: int, replays: int,
                           out: dict[int, Any] | None) -> None:
        """A planned call's host time by phase, what it returned, and its counts."""
        phases["plan"] = launched - start
        phases["driver"] = driver
        phases["record"] = end - launched - driver
        self._returned = placement.described if not out else {}
        self.stats.planned_calls += 1
        self.stats.region_replays += replays

    def _hold_inputs_in(self, placement: Placement | None) -> None:
        """``placement``'s argument lists are the ones to hold a call's inputs from now on:
        the lists that held the last call's let them go, so that only the last call's
        inputs stay referenced."""
        if self._filled is placement:
            return
        if self._filled is not None:
            self._filled.release_inputs()
        self._filled, self._filled_by = placement, None

    def _record_guarded(self, planned: PlannedCall, key: tuple, args: list, side: int) -> bool:
        """Record, without running them, the guarded launches not recorded yet (the regions
        of conditional regions: launched guarded, they must exist before the call). False
        when they cannot be: the call's inputs share memory, or a recording is not kept;
        the VM then runs this call (and every call at these dims, for the latter)."""
        if _share_memory(args):  # counted by the VM's call (``_call_vm``)
            return False
        for launch in planned.launches:
            if not launch.guards or self.backend.has(launch.region, launch.shape):
                continue
            self._record_region(launch.region, launch.shape,
                                planned.tensors(launch, args, self._pool, side), run=False)
            if not self.backend.has(launch.region, launch.shape):
                self._plans[key] = None  # a region run once, not kept: the VM reads the if
                return False
        return True

    def _record_launch(self, planned: PlannedCall, launch: Launch, args: list, side: int,
                       redirect: dict[int, Any] | None) -> None:
        """Record an unrecorded launch at its shape, and run it."""
        tensors = planned.tensors(launch, args, self._pool, side, redirect)
        if not launch.guards:
            self._record_region(launch.region, launch.shape, tensors, run=True)
            return
        self._record_region(launch.region, launch.shape, tensors, run=False)
        guards = planned.guards_as_tensors(launch, args, self._pool, side)
        if not self.backend.replay(launch.region, launch.shape, tensors, guards=guards):
            raise RuntimeError(f"{launch.region} at {launch.shape} could not be kept "
                               f"({self.backend.describe().get('not_kept_reason')}): it is "
                               "guarded by a data-dependent if and cannot run without its "
                               "recording")

    def _record_region(self, region: str, shape: tuple, tensors: list, run: bool) -> None:
        """The VM issues ``region`` at ``shape`` while the backend records it; ``run``: its
        kernels run too (else recorded without effects)."""
        recorder = self.backend.begin(region, shape, tensors)
        self._open = _Recording(region, recorder, run)
        try:  # on the backend's recording stream (begin), not the call's
            self._vm[region](*tensors, tvm_ffi.Shape(shape))
        except BaseException:
            self._abandon_recording()
            raise
        self._open = None
        self.backend.end(recorder, run=run)
        self._recorded()

    def _call_vm(self, args: list, key: tuple | None, out: dict[int, Any]) -> list:
        """The entry function on TVM's VM, regions intercepted (``_instrument``); recorded
        as they run unless the inputs share memory."""
        new_dims = key is not None and key not in self._plans
        self._recording = not _share_memory(args)
        if not self._recording:
            self.stats.unrecorded_calls += 1
        try:
            with self.backend.stream_context():
                result = self._vm[self.entry](*args)
            self._record_branches_not_taken()
        finally:
            self._recording = True
            self._branches_to_record = []
        values = _values(result, self.signature)
        self._scalars_as_tensors(values)
        if new_dims:
            if self._recording and self.program is None:
                self._remember(key, None)  # dims seen: the VM's pool counts new dims only
            self._after_new_dims(sum(nbytes(v) for v in values
                                     if isinstance(v, tvm.runtime.Tensor)))
        self._copy_out(values, out)  # the VM allocated its own
        return values

    def _scalars_as_tensors(self, values: list) -> None:
        """Outputs the entry returns as Python scalars (a value of shape arithmetic, as
        ``Shape(x)[0]``) as 0-d tensors of their declared dtype, like every other output."""
        for index, value in enumerate(values):
            if isinstance(value, (bool, int, float)):
                dtype = self.signature.outputs[index].dtype if self.signature else \
                    np.asarray(value).dtype.name
                values[index] = scalar_tensor(value, dtype, self.device)
                self.stats.add("h2d_bytes", nbytes(values[index]))

    def _copy_out(self, values: list, out: dict[int, Any]) -> None:
        """Copy outputs ``values`` into the caller's ``out`` tensors, which take their
        places in ``values``; counted in ``stats.d2d_bytes``. Every target is checked
        before any is written."""
        values_of = {index: _as_copyable(values[index]) for index in out}
        for index, target in out.items():
            _check_like(target, values_of[index], self.signature.outputs[index].name)
        with self.backend.stream_context():
            for index, target in out.items():
                target.copyfrom(values_of[index])
                copied = values_of[index]
                self.stats.add("d2d_bytes" if isinstance(copied, tvm.runtime.Tensor) else
                               "h2d_bytes", nbytes(copied))
                values[index] = target

    def _record_branches_not_taken(self) -> None:
        """Record, without running them, the regions of conditional regions the VM ran
        (reading the condition) that are still unrecorded: the branch it did not take. The
        next call at these dims launches both, guarded, with no host read."""
        for region, shape, args, _ in self._branches_to_record:
            if not self.backend.has(region, shape):
                self._record_region(region, shape, list(args), run=False)

    def _remember(self, key: tuple, plan: PlannedCall | None) -> None:
        """Keep the plan of ``key``'s dims, giving up the least recently used beyond
        ``max_shapes``."""
        self._plans[key] = plan
        self._plans.move_to_end(key)
        while len(self._plans) > self.max_shapes:
            self._plans.popitem(last=False)
            self.stats.evicted_shapes += 1
        self.stats.plans_held = len(self._plans)

    def _recorded(self) -> None:
        """A recording was kept: it may have evicted another (the backend's bound), so
        planned calls check theirs again (``region_recordings`` is their epoch)."""
        self.stats.region_recordings += 1
        self.stats.shapes_held = self.backend.shapes_held

    def _check_out(self, out: dict[int, Any], planned: PlannedCall) -> None:
        for index, target in out.items():  # each written by a kernel of its own
            name = self.signature.outputs[index].name
            shape, dtype = planned.output_spec(index)
            if tuple(target.shape) != shape or str(target.dtype) != dtype:
                raise InputError(f"out[{name!r}] is {target.dtype}{tuple(target.shape)}, this "
                                 f"call's output is {dtype}{shape}")

    def _prepare(self, inputs) -> _Prepared:
        """The entry function's arguments, the call's dims key, and the facts of the
        tensors passed: found again for inputs passed before as they are."""
        if self.signature is None:
            args = [self._as_tensor(f"#{i}", v) for i, v in enumerate(inputs)]
            # No program: the VM runs it, no side to choose.
            return _Prepared((), args, None, (), {}, reusable=False)
        if type(inputs) is not dict and not isinstance(inputs, Mapping):  # the ABC is slow
            raise TypeError(f"inputs must be a mapping from input name to array, got "
                            f"{type(inputs).__name__}")
        first = None
        for first in inputs.values():  # an input set is known by its first value
            break
        last = self._last_prepared
        if last is not None and last.first is first and last.passed_as(inputs):
            last.repeated = True
            return last  # the very tensors of the last call
        found = self._prepared.get(id(first))
        if found is not None and found.passed_as(inputs):
            found.repeated = True
            self._reuse(found)
            return found
        returned, before, recent = self._returned, self._checked, self._recent
        positions, checked = self._position, {}
        args = list(self._template)
        described, passed = [], []
        for name, value in inputs.items():
            position = positions.get(name)  # None: unknown, the signature names it below
            if position is not None and args[position] is not None:
                raise InputError(f"input {name!r} is bound (bind_inputs): it cannot also be "
                                 "passed to run(); bind it again to change it")
            # Our own output, or a tensor checked before (held, so its id is its own): a
            # TVM tensor's shape, dtype, device and layout never change.
            facts = returned.get(id(value))
            if facts is None or facts.tensor is not value:
                facts = before.get(id(value)) or recent.get(id(value)) or \
                    self._checked_input(name, value)
                if facts.tensor is value:  # a caller's TVM tensor (not a copy of one)
                    checked[id(value)] = facts
            if position is not None:
                args[position] = facts.tensor
            passed.append(facts)
            described.append((name, facts.shape, facts.dtype))
        described = tuple(described)
        key = self._dims_of.get(described)
        if key is None:
            key = self._dims_key(described)
        self._keep_recent(before, checked)
        # Only TVM tensors read in place can stand for themselves next time: a host array
        # was copied here, and may have changed since.
        prepared = _Prepared(tuple(inputs.items()), args, key, passed, checked,
                             reusable=len(checked) == len(inputs))
        if prepared.reusable and inputs and all(facts.small for facts in passed):
            self._remember_prepared(prepared)  # small tensors only, as ``_recent``
        self._last_prepared = prepared if prepared.reusable else None
        return prepared

    def _reuse(self, prepared: _Prepared) -> None:
        """``prepared``'s tensors, passed again as they were, become the last call's
        (``_keep_recent``), as if checked again."""
        self._keep_recent(self._checked, prepared.checked)
        self._last_prepared = prepared

    def _remember_prepared(self, prepared: _Prepared) -> None:
        """Keep a call's checked input set, at most ``RECENT_TENSORS`` + 1 of them (the
        last call's and those of calls before), the oldest given up first."""
        remembered = self._prepared
        first = id(prepared.first)
        remembered.pop(first, None)
        remembered[first] = prepared
        if len(remembered) > RECENT_TENSORS + 1:
            del remembered[next(iter(remembered))]

    def _keep_recent(self, before: dict[int, TensorFacts], checked: dict[int, TensorFacts]
                     ) -> None:
        """This call's tensors become the last call's; the last call's that this one did
        not pass join ``_recent`` if small, the oldest leaving beyond ``RECENT_TENSORS``,
        and with it the input sets remembered that hold it (``_forget``): the executor
        holds no caller tensor but the last call's and ``_recent``."""
        recent = self._recent
        for key in checked:  # this call's tensors are the last call's now, not recent ones
            recent.pop(key, None)
        for key, facts in before.items():
            if key in checked:
                continue
            if not facts.small:  # let go (never in a remembered input set)
                continue
            recent[key] = facts
            if len(recent) > RECENT_TENSORS:
                oldest = next(iter(recent))
                del recent[oldest]
                self._forget(oldest)
        self._checked = checked

    def _forget(self, key: int) -> None:
        """Drop the remembered input sets that hold the tensor of id ``key`` (at most
        ``RECENT_TENSORS`` + 1 sets to look through, on the calls that let a tensor go)."""
        remembered = self._prepared
        if remembered:
            for first in [first for first, p in remembered.items() if key in p.checked]:
                del remembered[first]

    def _transposed_host(self, name: str, value: Any) -> np.ndarray:
        """A weight the entry takes transposed, on the host as the model declares it: a
        host array as it is, a device tensor read back (counted), to be transposed and
        copied once (a bind is not a call; no kernel of the artifact transposes)."""
        if isinstance(value, np.ndarray):
            return value
        host = self._as_tensor(name, value).numpy()
        self.stats.add("d2h_bytes", host.nbytes)
        return host

    def _checked_input(self, name: str, value: Any) -> TensorFacts:
        """The facts of an input not seen before, checked (``_as_tensor``)."""
        if name in self.transposed_inputs:
            raise InputError(f"input {name!r} is a weight this build reads transposed: bind it "
                             "once with bind_inputs (which transposes it), do not pass it to "
                             "run()")
        tensor = self._as_tensor(name, value)
        shape, dtype = tuple(tensor.shape), str(tensor.dtype)
        return TensorFacts(tensor, shape, dtype,
                           small=nbytes_of(shape, dtype) <= RECENT_TENSOR_BYTES)

    def _dims_key(self, described: tuple) -> tuple:
        """The dims of inputs ``described`` (name, shape, dtype), checked against the
        signature (which names a missing, unknown or mismatched input); remembered."""
        dims = self.signature.bind({n: s for n, s, _ in described},
                                   {n: d for n, _, d in described},
                                   bound=self._bound_dims.values, skip=self._bound)
        key = tuple(sorted(dims.items()))
        if len(self._dims_of) >= 1 << 16:  # a bound: shapes are many, memory is not
            self._dims_of.clear()
        self._dims_of[described] = key
        return key

    def _as_tensor(self, name: str, value: Any, copy: bool = True) -> tvm.runtime.Tensor:
        if isinstance(value, tvm.runtime.Tensor):
            tensor = value
        elif copy and (isinstance(value, np.ndarray) or np.isscalar(value)):
            array = np.asarray(value, order="C")  # keeps a 0-d input 0-d
            _check_host_array(name, array)
            self.stats.add("h2d_bytes", array.nbytes)
            return tvm.runtime.tensor(array, self.device)
        elif hasattr(value, "__dlpack__"):
            tensor = self._from_dlpack(name, value, copy)
        else:
            raise TypeError(f"input {name!r}: expected a numpy array or a DLPack tensor, got "
                            f"{type(value).__name__}")
        if not tensor.device == self.device:  # one comparison: device type and index
            raise ValueError(f"input {name!r} is on {tensor.device}, the executor runs on "
                             f"{self.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"input {name!r} cannot be read in place: it is not contiguous "
                             f"(strides {tensor.strides}); the kernels read dense row-major "
                             "tensors, pass a contiguous copy")
        return tensor

    def _from_dlpack(self, name: str, value: Any, copy: bool) -> tvm.runtime.Tensor:
        """A DLPack tensor as a TVM tensor over the same memory.

        TVM's kernels assume data aligned to ``ALIGNMENT`` bytes (its own ``from_dlpack``
        refuses anything else). A misaligned input is copied once into an aligned tensor and
        the copy is counted; a misaligned ``out=`` buffer cannot be written in place and is
        refused. The layout is checked first so that a strided view is named as such.
        """
        try:
            tensor = tvm_ffi.from_dlpack(value)
        except Exception as err:  # pylint: disable=broad-except
            raise ValueError(f"input {name!r} cannot be read in place: {err}") from None
        if not tensor.is_contiguous() or tensor.data_ptr() % ALIGNMENT == 0:
            return tensor
        if not copy:
            raise ValueError(f"input {name!r} cannot be written in place: its data is not "
                             f"aligned to {ALIGNMENT} bytes (the kernels assume aligned "
                             "buffers); pass an aligned buffer")
        aligned = tvm.runtime.empty(tensor.shape, tensor.dtype, tensor.device)
        aligned.copyfrom(tensor)
        self.stats.add("h2d_bytes" if _on_host(tensor.device) else "d2d_bytes", nbytes(tensor))
        return aligned

    def _name_outputs(self, values: list) -> dict[str, tvm.runtime.Tensor] | list:
        if self.signature is None:
            return values
        names = self._output_names
        if len(values) != len(names):
            raise RuntimeError(f"the model returned {len(values)} values for outputs {names}")
        if len(names) == 1:  # most models: a literal is a fraction of dict(zip())
            return {names[0]: values[0]}
        return dict(zip(names, values))

    def _abandon_recording(self) -> None:
        # A failed call must leave the executor usable: drop a half-made recording.
        if self._open is not None:
            self.backend.abort(self._open.recorder)
            self._open = None

    def trace(self, inputs: Mapping[str, Any]) -> tuple[list[tuple[str, tuple, list]], list]:
        """The region calls (name, shape, arguments) and outputs of a call on ``inputs``,
        without running it: for a caller that issues them itself (``DeviceLoop``).

        Needs a planned call at these dims (a call program, and a call made before at
        them); the arguments are the given input tensors, bound inputs and the executor's
        buffers.
        """
        with self._lock:
            self._check_open()
            prepared = self._prepare(inputs)
            args, key = prepared.args, prepared.key
            planned = self._plans.get(key)
            if planned is None:
                raise RuntimeError(f"no planned call at dims {dict(key or ())}: run the model "
                                   "once at these dims first (a model with host steps has no "
                                   "call program)")
            if planned.guarded:
                raise NotImplementedError("this call has data-dependent branches (conditional "
                                          "regions): it cannot be re-issued region by region")
            side = self._output_side(prepared.passed, _NO_TARGETS)
            if side is None:
                raise InputError("the inputs live in the executor's own buffers: pass tensors "
                                 "of your own")
            calls = [(launch.region, launch.shape, planned.tensors(launch, args, self._pool, side))
                     for launch in planned.launches]
            held = planned.placed(self._pool, side, self.backend.addresses_only).outputs
            return calls, planned.outputs(held, args, None)

    # -- region interception -------------------------------------------------------------
    def _instrument(self, func, symbol: str, before_run: bool, _ret, *args) -> int:
        if self._open is not None:
            return self._while_recording(func, symbol, before_run, args)
        if symbol.startswith(CONDITIONAL_PREFIX):
            return self._on_conditional(symbol, before_run, args)
        if before_run and symbol.startswith(REGION_PREFIX):
            shape = tuple(int(v) for v in args[-1])
            if self.backend.replay(symbol, shape, args[:-1]):
                self.stats.region_replays += 1
                return VMInstrumentReturnKind.SKIP_RUN
            if self._recording:
                self._open = _Recording(symbol, self.backend.begin(symbol, shape, args[:-1]),
                                        run=True, by_vm=True)
        return VMInstrumentReturnKind.NO_OP

    def _on_conditional(self, symbol: str, before_run: bool, args) -> int:
        """A conditional region called by the VM. When every region of both its branches
        is recorded at these dims, they are launched here, each guarded by the condition,
        and the VM skips the call: no host read, on the VM path too. Otherwise the VM runs
        it (reading the condition, recording the branch it takes)."""
        if not before_run:  # the VM ran it (a skipped call has no "after")
            return VMInstrumentReturnKind.NO_OP
        calls = guarded_calls(self.branches, symbol, tuple(int(v) for v in args[-1]), args[:-1])
        if not calls or not all(self.backend.has(region, s) for region, s, _, _ in calls):
            self.stats.add("host_branch_reads", 1)
            if calls and self._recording:  # the branch not taken: recorded after the call
                self._branches_to_record += calls
            return VMInstrumentReturnKind.NO_OP
        for region, region_shape, region_args, guards in calls:
            self.backend.replay(region, region_shape, region_args, guards=guards)
        self.stats.region_replays += len(calls)
        return VMInstrumentReturnKind.SKIP_RUN

    def _while_recording(self, func, symbol: str, before_run: bool, args) -> int:
        recording = self._open
        if symbol == recording.region:
            if recording.by_vm and not before_run:  # the VM's own call of it returned
                self._open = None
                self.backend.end(recording.recorder)
                self._recorded()
            return VMInstrumentReturnKind.NO_OP
        if before_run:
            recording.recorder.on_call(func, symbol, args)
            # Recorded, not run (no side effect): the kernels, not the host's shape
            # bookkeeping (VM builtins, VMShapeLower's shape functions) they depend on.
            if not recording.run and self.backend.records_by_running and \
                    not symbol.startswith(("vm.builtin.", "shape_func")):
                return VMInstrumentReturnKind.SKIP_RUN
        return VMInstrumentReturnKind.NO_OP

    # -- recording ahead of time ----------------------------------------------------------
    def record_all(self, dims: Mapping[str, Sequence[int]] | None = None, *,
                   progress: bool = True) -> float:
        """Record every shape of the declared ranges now, instead of on first sight.

        Runs the model once per combination of dim values (``dims`` narrows them) on zero
        inputs (bound inputs, see ``bind_inputs``, as they are); returns the seconds it took.
        Shapes already recorded are replayed, not recorded again. Refused (``InputError``)
        for more combinations than the executor keeps (``max_shapes``), and before the
        weights the build reads transposed are bound.
        """
        if self.signature is None:
            raise ValueError("record_all needs the model's signature (load it from an artifact)")
        unknown = sorted(set(dims or ()) - set(self.signature.dims))
        if unknown:
            raise InputError(f"record_all: {unknown} are not dimensions of the model; its "
                             f"dimensions are {sorted(self.signature.dims)}")
        unbound = sorted(set(self.transposed_inputs) - set(self._bound))
        if unbound:  # zeros stand for the other inputs; these must be bound (transposed)
            raise InputError(f"record_all: bind {unbound} first (bind_inputs): this build reads "
                             "them transposed, as they are bound")
        values = {name: list(dims[name]) if dims and name in dims else range(rng.lo, rng.hi + 1)
                  for name, rng in self.signature.dims.items()}
        shapes = math.prod(len(v) for v in values.values())
        if shapes > self.max_shapes:  # the first given up before the last is recorded
            raise InputError(f"record_all: the ranges {_ranges(values)} are {shapes} shapes, "
                             f"more than this executor keeps (max_shapes={self.max_shapes}): "
                             "narrow them with dims=, or load with a larger max_shapes")
        bar = Progress(shapes, "grape-tvm: recording shapes", enabled=progress)
        for combo in itertools.product(*values.values()):
            bound = dict(zip(values, combo))
            self.run({spec.name: np.zeros([bound[d] if isinstance(d, str) else d
                                           for d in spec.shape], spec.dtype)
                      for spec in self.signature.inputs if spec.name not in self._bound},
                     return_numpy=False)
            bar.step()
        self.backend.synchronize()
        return bar.close()

    # -- what is held ----------------------------------------------------------------------
    @property
    def recorded_shapes(self) -> dict[str, list[tuple[int, ...]]]:
        return self.backend.recorded_shapes()

    def close(self) -> None:
        """Free everything this executor holds: graphs, streams, buffers, plans, bound
        inputs and its VM. Later calls raise; closing twice is harmless."""
        with self._lock:
            if self._vm is None:
                return
            self.backend.close()
            self._vm = None
            self._plans.clear()
            self._pool.close()
            self._bound.clear()
            self._bound_dims, self._bound_spans = BoundDims(), _Spans(())
            self._template = [None] * len(self._template)
            self._returned, self._checked, self._recent, self._dims_of = {}, {}, {}, {}
            self._prepared = {}
            self._last_prepared = self._filled = self._filled_by = None
            self.stats.plans_held = self.stats.shapes_held = 0

    def _check_open(self) -> None:
        if self._vm is None:
            raise RuntimeError("this executor is closed")

    def __enter__(self) -> "GraphExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_NO_TARGETS: dict[int, Any] = {}  # run() without out= (never written)
_UNSEEN = object()  # dims not in ``_plans`` (None there means: the VM runs them)


def _ranges(values: Mapping[str, Sequence[int]]) -> str:
    return ", ".join(f"{name}={v[0]}..{v[-1]}" if isinstance(v, range) else f"{name}={list(v)}"
                     for name, v in values.items())


def _on_host(device) -> bool:
    return device.dlpack_device_type() == tvm.cpu().dlpack_device_type()


def _is_record(dtype: np.dtype) -> bool:
    """A structured or raw-bytes dtype (``void8``, ``[("a", "<f4")]``), not a number type
    registered by ml_dtypes."""
    return dtype.fields is not None or dtype.name.startswith("void")


def _check_host_array(name: str, array: np.ndarray) -> None:
    """Refuse, naming the input, what a TVM tensor cannot hold (TVM would only say "unknown
    dtype"): Python objects or strings, raw or structured records, and a byte order other
    than the host's. ml_dtypes' numbers (bfloat16, float8_*) are of kind "V" too: kept."""
    if array.dtype.kind in "OSU" or array.dtype.kind == "V" and _is_record(array.dtype):
        raise InputError(f"input {name!r} has dtype {array.dtype}: not an array of numbers")
    if not array.dtype.isnative:
        order = "big" if array.dtype.byteorder == ">" else "little"
        raise InputError(f"input {name!r} is {order}-endian ({array.dtype.str}), expected the "
                         f"host's byte order: pass .astype({array.dtype.newbyteorder('=').name!r})")


def _values(result, signature: Signature | None = None) -> list:
    """The entry function's outputs: one tensor or shape, or a tuple of them. A shape is a
    tuple too (``tvm_ffi.Shape``): it is one output, not several."""
    if isinstance(result, (tvm.runtime.Tensor, tvm_ffi.Shape, bool, int, float)):
        return [result]
    return [list(result)] if _one_sequence(signature) else list(result)


def _one_sequence(signature: Signature | None) -> bool:
    """Whether the model's one output is a sequence: the tuple its entry function returns
    is then that one output (a list), not several."""
    return signature is not None and len(signature.outputs) == 1 and \
        signature.outputs[0].kind == "sequence"


def _numpy(value):
    if isinstance(value, tvm_ffi.Shape):
        return np.array(list(value), dtype=np.int64)  # ONNX's Shape: an int64 tensor
    if isinstance(value, tvm.runtime.Tensor):
        return value.numpy()
    return [_numpy(v) for v in value]  # a sequence of tensors


def _to_numpy(outputs):
    if isinstance(outputs, dict):
        return {k: _numpy(v) for k, v in outputs.items()}
    return [_numpy(v) for v in outputs]


def default_backend(device: tvm.runtime.Device, max_shapes: int | None = None) -> RegionBackend:
    """CUDA graphs on a CUDA device, CPU replay on the CPU."""
    if device.dlpack_device_type() == tvm.cuda(0).dlpack_device_type():
        from .cuda_backend import CudaGraphBackend  # pylint: disable=import-outside-toplevel

        return CudaGraphBackend(device, max_shapes=max_shapes)
    from .cpu_replay import CpuReplayBackend  # pylint: disable=import-outside-toplevel

    return CpuReplayBackend(device, max_shapes)


def _weakly_bound(method):
    """``method`` as a plain function holding its object weakly (``weakref.WeakMethod``):
    a call after the object is gone does nothing (``NO_OP``)."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        return VMInstrumentReturnKind.NO_OP if bound is None else bound(*args)

    return call


def _spans(tensors: Iterable[Any]) -> list[tuple[int, int]]:
    """The memory (start, end) of the non-empty tensors among ``tensors``, sorted."""
    return sorted((t.data_ptr(), t.data_ptr() + nbytes(t))
                  for t in tensors if isinstance(t, tvm.runtime.Tensor) and nbytes(t))


def _share_memory(tensors: Sequence[Any]) -> bool:
    """Whether two of ``tensors`` (tensors and other values) overlap in memory."""
    spans = _spans(tensors)
    return any(start < end for (_, end), (start, _) in zip(spans, spans[1:]))


class _Spans:
    """The memory of some tensors, sorted, to ask whether a span overlaps any (by bisection:
    ``ends`` holds the largest end of the spans up to each)."""

    def __init__(self, tensors: Iterable[Any]):
        spans = _spans(tensors)
        self.starts = [start for start, _ in spans]
        self.ends = list(itertools.accumulate((end for _, end in spans), max))

    def overlaps(self, start: int, end: int) -> bool:
        below = bisect.bisect_left(self.starts, end)  # the spans that start before ``end``
        return below > 0 and self.ends[below - 1] > start


def _as_copyable(value):
    """An output as ``copyfrom`` takes it: a shape (ONNX's ``Shape``) as its numbers."""
    return _numpy(value) if isinstance(value, tvm_ffi.Shape) else value


def _clear_vm_memory_pools(trim_host: bool) -> None:
    """Free the buffers TVM's VMs keep pooled and unused (every VM of the process shares
    the pool of a device: the others allocate again what they need); ``trim_host``: also
    give the host memory freed back to the system: glibc keeps freed heap pages otherwise,
    and buffers of many sizes leave it fragmented (bench/memory.py)."""
    clear = tvm.get_global_func("vm.builtin.memory_manager.clear", allow_missing=True)
    if clear is not None:
        clear()
    if trim_host and _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def _bytes(outputs) -> int:
    values = outputs.values() if isinstance(outputs, dict) else outputs
    return sum(int(v.nbytes) if isinstance(v, np.ndarray) else _bytes(v) for v in values)


def _check_like(target, value, name: str) -> None:
    if tuple(target.shape) != tuple(value.shape) or str(target.dtype) != str(value.dtype):
        raise InputError(f"out[{name!r}] is {target.dtype}{tuple(target.shape)}, this call's "
                         f"output is {value.dtype}{tuple(value.shape)}")
