"""``GraphExecutor``: host steps through TVM's VM, regions through recorded graphs."""

from __future__ import annotations

import ctypes
import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm.runtime.vm import VirtualMachine, VMInstrumentReturnKind

from .call_plan import BufferPool, CallPlan, CallPlanRecorder, guarded_calls
from .progress import Progress
from .signature import InputError, Signature, nbytes

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

REGION_PREFIX = "grape_region_"  # the names LiftGraphRegions gives region functions
CONDITIONAL_PREFIX = "grape_cond_"  # and BranchesToConditionalRegions, conditional regions


@dataclass
class CallStats:
    """What the executor did, summed over calls (``last`` holds the last call's figures)."""

    calls: int = 0
    region_replays: int = 0
    region_recordings: int = 0
    planned_calls: int = 0  # calls that ran without the VM
    h2d_bytes: int = 0  # host arrays copied to the device (numpy inputs)
    d2h_bytes: int = 0  # outputs copied back to numpy
    d2d_bytes: int = 0  # device copies the executor made (out= on the VM path)
    graph_launches: int = 0
    host_branch_reads: int = 0  # conditional regions the VM ran, reading the condition
    unrecorded_calls: int = 0  # VM calls not recorded: their inputs share memory
    evicted_shapes: int = 0  # dims whose plan was given up (max_shapes)
    # Held now (not summed): plans of dims, and (region, shape) recordings of the backend.
    plans_held: int = 0
    shapes_held: int = 0
    last: dict[str, Any] = field(default_factory=dict)

    def begin_call(self) -> None:
        self.last = {"h2d_bytes": 0, "d2h_bytes": 0, "d2d_bytes": 0, "graph_launches": 0,
                     "path": "vm"}

    def add(self, key: str, value: int) -> None:
        self.last[key] = self.last.get(key, 0) + value
        setattr(self, key, getattr(self, key) + value)


class GraphExecutor:
    """Run a grape-compiled module on one device.

    The first call at given dims runs the entry function on TVM's VM; each call of a region
    function is intercepted: at a shape seen before the backend replays it (one graph launch
    on CUDA) and the VM skips the call; at a new shape the VM runs it while the backend
    records it. When the entry function has no host step (``plan_calls``), later calls at
    those dims skip the VM altogether (``CallPlan``) and run on buffers the executor owns.

    A conditional region (a data-dependent ``if``, ``branches`` from the artifact's plan)
    launches the regions of both branches, each guarded by the condition, which the
    backend checks on the device: no host read. Until both are recorded at their shapes
    the VM runs it instead (reading the condition, counted in ``stats.host_branch_reads``):
    the branch taken is recorded as it runs, the other one recorded without running.

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
                 signature: Signature | None = None, backend=None, entry: str = "main",
                 plan_calls: bool = False, branches: Mapping[str, dict] | None = None,
                 max_shapes: int = DEFAULT_MAX_SHAPES):
        if max_shapes < 1:
            raise ValueError(f"max_shapes must be at least 1, got {max_shapes}")
        self.device = device
        self.branches = dict(branches or {})
        self.signature = signature
        self.max_shapes = max_shapes
        self.backend = backend if backend is not None else default_backend(device, max_shapes)
        self.entry = entry
        self.stats = CallStats()
        self._vm = VirtualMachine(executable, device)
        # The VM keeps its instrument alive, and the executor its VM: a strong reference
        # back would make a cycle through TVM's FFI that Python's collector cannot see.
        self._vm.set_instrument(_weakly_bound(self._instrument))
        self._open: tuple[str, Any, bool] | None = None  # (region, recorder, run) while recording
        self._recording = True  # False during a call whose inputs share memory
        self._lock = threading.Lock()
        # Calls without the VM: only for an entry function with no host step (see call_plan).
        self._plan_calls = plan_calls and signature is not None
        # Dims seen, least recently used first: their plan, or None (no plan possible).
        self._plans: OrderedDict[tuple, CallPlan | None] = OrderedDict()
        # VM calls at new dims since the VM's memory pool was emptied, and their outputs' bytes.
        self._vm_pool_calls = self._vm_pool_bytes = 0
        self._on_cpu = _on_host(device)
        self._vm_pool_limit = VM_POOL_CLEAR_BYTES["cpu" if self._on_cpu else "gpu"]
        self._watch: CallPlanRecorder | None = None
        self._pool = BufferPool(device)
        self._buffer_of: dict[tuple, int] = {}
        self._bound: dict[str, tvm.runtime.Tensor] = {}
        self._bound_dims: dict[str, int] = {}
        self.bound_version = 0  # bumped by bind_inputs: graphs holding bound addresses are stale
        inputs = signature.inputs if signature is not None else ()
        self._position = {t.name: i for i, t in enumerate(inputs)}
        self._template: list[Any] = [None] * len(inputs)  # bound inputs in place
        self._fixed: list[int] = []  # their positions
        # Fast paths of a call's checks: the last planned call's outputs (an autoregressive
        # caller passes them straight back) and the dims of input shapes seen before.
        self._returned: dict[int, tuple] = {}
        self._dims_of: dict[tuple, tuple] = {}

    # -- calls ---------------------------------------------------------------------------
    def bind_inputs(self, inputs: Mapping[str, Any]) -> None:
        """Fix inputs that do not change from call to call (weights): checked and moved to
        the device once, then left out of ``run``'s inputs."""
        if self.signature is None:
            raise ValueError("bind_inputs needs the model's signature (load it from an artifact)")
        with self._lock:
            self._check_open()
            tensors = {name: self._as_tensor(name, value) for name, value in inputs.items()}
            specs = {t.name for t in self.signature.inputs}
            unknown = sorted(set(tensors) - specs)
            if unknown:
                raise InputError(f"unknown input(s) {unknown}: the model takes {sorted(specs)}")
            dims = self.signature.bind({k: tuple(t.shape) for k, t in tensors.items()},
                                       {k: str(t.dtype) for k, t in tensors.items()},
                                       partial=True)
            self._bound.update(tensors)
            self._bound_dims.update(dims)
            self._template = [self._bound.get(t.name) for t in self.signature.inputs]
            self._fixed = [i for i, t in enumerate(self._template) if t is not None]
            self._plans.clear()
            self._returned, self._dims_of = {}, {}
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
        (``return_numpy=False``) belong to the executor and stay valid until its next call
        (an output fed back as the next call's input is read in place). ``out`` maps output
        names to device tensors of the caller's, written directly. Without a signature (an
        executable straight from ``tvm.compile``) inputs are positional and outputs come
        back as a list. ``stats`` counts copies and launches.
        """
        with self._lock:
            self._check_open()
            self.stats.begin_call()
            args, key, passed = self._prepare(inputs)
            targets = self._prepare_out(out)
            launches = self._launches()
            try:
                with self.backend.stream_context():
                    outputs = self._call(args, key, passed, targets)
                    if return_numpy:
                        outputs = _to_numpy(outputs)
                        self.stats.add("d2h_bytes", _bytes(outputs))
            except BaseException:
                self._abandon_recording()
                raise
            self.stats.add("graph_launches", self._launches() - launches)
            self.stats.calls += 1
            self.stats.plans_held = len(self._plans)
            self.stats.shapes_held = self.backend.shapes_held
            return outputs

    __call__ = run

    def _launches(self) -> int:
        return getattr(self.backend, "launches", 0)

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
            targets[names.index(name)] = self._as_tensor(f"out[{name!r}]", value, copy=False)
        return targets

    def _call(self, args: list, key: tuple | None, passed: list, out: dict[int, Any]):
        plan = self._plans.get(key) if key is not None else None
        if plan is not None:
            self._plans.move_to_end(key)
        side = None
        if plan is not None:
            # Our own outputs passed back: their side is known; the rest are looked up.
            unknown, hit = list(out.values()), set()
            for t in passed:
                known = self._returned.get(id(t))
                if known is None:
                    unknown.append(t)
                else:
                    hit.add(known[3])
            side = self._pool.side_for(unknown, hit)
        if plan is not None and side is not None:
            self._check_out(out, plan)
            outputs = plan.run(args, self._pool, self.backend, side, out)
            self._returned = plan.described(side)
            if outputs is None:
                # A region lost its recording (a bounded per-shape cache): the VM records
                # it again, watched, so that a branch it does not take is recorded too.
                del self._plans[key]
            else:
                self.stats.planned_calls += 1
                self.stats.region_replays += len(plan.regions)
                self.stats.last["path"] = "planned"
                return self._name_outputs(outputs)
        self._returned = {}
        values, recorder = self._call_vm(args, key)
        if recorder is not None:
            plan = recorder.finish(values, self._pool, self._buffer_of)
            self._remember(key, plan)
            if plan is not None and plan.guarded:
                try:
                    self._record_branches_not_taken(recorder)
                except BaseException:
                    del self._plans[key]  # planned calls would find a branch unrecorded
                    raise
        elif key is not None and not self._plan_calls and self._recording:
            self._remember(key, None)  # dims seen (for the VM's pool), nothing to plan
        for index, target in out.items():  # the VM allocated its own: copy, and count it
            _check_like(target, values[index], self.signature.outputs[index].name)
            target.copyfrom(values[index])
            self.stats.add("d2d_bytes", nbytes(values[index]))
            values[index] = target
        return self._name_outputs(values)

    def _call_vm(self, args: list, key: tuple | None) -> tuple[list, CallPlanRecorder | None]:
        """The entry function on TVM's VM, regions intercepted (``_instrument``); a call at
        dims without a plan is watched, to make one, unless its inputs share memory."""
        new_dims = key is not None and key not in self._plans
        self._recording = not _share_memory(args)
        if not self._recording:
            self.stats.unrecorded_calls += 1
        watch = self._plan_calls and new_dims and self._recording
        self._watch = CallPlanRecorder(args, self._fixed) if watch else None
        try:
            result = self._vm[self.entry](*args)
        finally:
            recorder, self._watch, self._recording = self._watch, None, True
        values = _values(result, self.signature)
        if new_dims:
            self._vm_pool_calls += 1
            self._vm_pool_bytes += sum(nbytes(v) for v in values
                                       if isinstance(v, tvm.runtime.Tensor))
            if self._vm_pool_calls >= VM_POOL_CLEAR_CALLS or \
                    self._vm_pool_bytes >= self._vm_pool_limit:
                _clear_vm_memory_pools(trim_host=self._on_cpu)
                self._vm_pool_calls = self._vm_pool_bytes = 0
        return values, recorder

    def _remember(self, key: tuple, plan: CallPlan | None) -> None:
        """Keep the plan of ``key``'s dims, giving up the least recently used beyond
        ``max_shapes``."""
        self._plans[key] = plan
        self._plans.move_to_end(key)
        while len(self._plans) > self.max_shapes:
            self._plans.popitem(last=False)
            self.stats.evicted_shapes += 1

    def _check_out(self, out: dict[int, Any], plan: CallPlan) -> None:
        for index, target in out.items():
            name = self.signature.outputs[index].name
            if plan.outputs[index].kind != "buffer":
                raise InputError(f"output {name!r} is an input passed through: it cannot be "
                                 "written to out=")
            _check_like(target, plan.outputs[index], name)  # a Slot has the output's shape

    def _prepare(self, inputs) -> tuple[list[tvm.runtime.Tensor], tuple | None, list]:
        """The entry function's arguments, the call's dims key, and the tensors passed."""
        if self.signature is None:
            args = [self._as_tensor(f"#{i}", v) for i, v in enumerate(inputs)]
            return args, None, args
        if not isinstance(inputs, Mapping):
            raise TypeError(f"inputs must be a mapping from input name to array, got "
                            f"{type(inputs).__name__}")
        tensors, described = {}, []
        for name, value in inputs.items():
            if name in self._bound:
                raise InputError(f"input {name!r} is bound (bind_inputs): it cannot also be "
                                 "passed to run(); bind it again to change it")
            known = self._returned.get(id(value))
            if known is not None and known[0] is value:  # our own output, checked when made
                tensors[name] = value
                described.append((name, known[1], known[2]))
            else:
                tensor = tensors[name] = self._as_tensor(name, value)
                described.append((name, tuple(tensor.shape), str(tensor.dtype)))
        described = tuple(described)
        key = self._dims_of.get(described)
        if key is None:
            dims = self.signature.bind({n: s for n, s, _ in described},
                                       {n: d for n, _, d in described},
                                       bound=self._bound_dims, skip=self._bound)
            key = tuple(sorted(dims.items()))
            if len(self._dims_of) >= 1 << 16:  # a bound: shapes are many, memory is not
                self._dims_of.clear()
            self._dims_of[described] = key
        args = list(self._template)
        for name, tensor in tensors.items():
            args[self._position[name]] = tensor
        return args, key, list(tensors.values())

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
        if tensor.device.dlpack_device_type() != self.device.dlpack_device_type() or \
                tensor.device.index != self.device.index:
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
        names = [spec.name for spec in self.signature.outputs]
        if len(values) != len(names):
            raise RuntimeError(f"the model returned {len(values)} values for outputs {names}")
        return dict(zip(names, values))

    def _abandon_recording(self) -> None:
        # A failed call must leave the executor usable: drop a half-made recording.
        if self._open is not None:
            self.backend.abort(self._open[1])
            self._open = None

    def _record_branches_not_taken(self, watched: CallPlanRecorder) -> None:
        """Record, without running them, the regions of the branches the VM did not take:
        a planned call launches both (guarded), so both need their recording."""
        for region, shape, args, expects in watched.calls:
            if not expects or self.backend.has(region, shape):
                continue
            args = args[:len(args) - len(expects)]
            recorder = self.backend.begin(region, shape, args)
            self._open = (region, recorder, False)
            try:
                self._vm[region](*args, tvm_ffi.Shape(shape))
            except BaseException:
                self._abandon_recording()
                raise
            self._open = None
            self.backend.end(recorder, run=False)
            self.stats.region_recordings += 1

    def trace(self, inputs: Mapping[str, Any]) -> tuple[list[tuple[str, tuple, list]], list]:
        """The region calls (name, shape, arguments) and outputs of a call on ``inputs``,
        without running it: for a caller that issues them itself (``DeviceLoop``).

        Needs a plan at these dims (``plan_calls`` and a call made before at them); the
        arguments are the given input tensors, bound inputs and the executor's buffers.
        """
        with self._lock:
            self._check_open()
            args, key, passed = self._prepare(inputs)
            plan = self._plans.get(key)
            if plan is None:
                raise RuntimeError(f"no call plan at dims {dict(key or ())}: run the model once "
                                   "at these dims first (an entry function with host steps has "
                                   "none)")
            side = self._pool.side_for(passed)
            if side is None:
                raise InputError("the inputs live in the executor's own buffers: pass tensors "
                                 "of your own")
            return plan.calls(args, self._pool, side)

    # -- region interception -------------------------------------------------------------
    def _instrument(self, func, symbol: str, before_run: bool, _ret, *args) -> int:
        if self._open is not None:
            return self._while_recording(func, symbol, before_run, args)
        if symbol.startswith(CONDITIONAL_PREFIX):
            return self._on_conditional(symbol, before_run, args)
        if before_run and symbol.startswith(REGION_PREFIX):
            shape = tuple(int(v) for v in args[-1])
            if self._watch is not None:
                self._watch.on_region(symbol, shape, args[:-1])
            if self.backend.replay(symbol, shape, args[:-1]):
                self.stats.region_replays += 1
                return VMInstrumentReturnKind.SKIP_RUN
            if self._recording:
                self._open = (symbol, self.backend.begin(symbol, shape, args[:-1]), True)
        return VMInstrumentReturnKind.NO_OP

    def _on_conditional(self, symbol: str, before_run: bool, args) -> int:
        """A conditional region called by the VM. When every region of both its branches
        is recorded at these dims, they are launched here, each guarded by the condition,
        and the VM skips the call: no host read, on the VM path too. Otherwise the VM runs
        it (reading the condition, recording the branch it takes) and the plan, if one is
        being made, gets both branches."""
        if not before_run:  # the VM ran it (a skipped call has no "after")
            if self._watch is not None:
                self._watch.end_conditional()
            return VMInstrumentReturnKind.NO_OP
        calls = guarded_calls(self.branches, symbol, tuple(int(v) for v in args[-1]), args[:-1])
        if self._watch is not None:
            self._watch.on_conditional(symbol, calls)
        if not calls or not all(self.backend.has(region, s) for region, s, _, _ in calls):
            self.stats.add("host_branch_reads", 1)
            return VMInstrumentReturnKind.NO_OP
        for region, region_shape, region_args, guards in calls:
            self.backend.replay(region, region_shape, region_args, guards=guards)
        self.stats.region_replays += len(calls)
        if self._watch is not None:
            self._watch.end_conditional()  # no "after" for a skipped call
        return VMInstrumentReturnKind.SKIP_RUN

    def _while_recording(self, func, symbol: str, before_run: bool, args) -> int:
        region, recorder, run = self._open
        if symbol == region:
            if run and not before_run:
                self._open = None
                self.backend.end(recorder)
                self.stats.region_recordings += 1
            return VMInstrumentReturnKind.NO_OP
        if before_run:
            recorder.on_call(func, symbol, args)
            # Recorded, not run (no side effect): the kernels, not the host's shape
            # bookkeeping (VM builtins, VMShapeLower's shape functions) they depend on.
            if not run and getattr(self.backend, "records_by_running", False) and \
                    not symbol.startswith(("vm.builtin.", "shape_func")):
                return VMInstrumentReturnKind.SKIP_RUN
        return VMInstrumentReturnKind.NO_OP

    # -- recording ahead of time ----------------------------------------------------------
    def record_all(self, dims: Mapping[str, Sequence[int]] | None = None, *,
                   progress: bool = True) -> float:
        """Record every shape of the declared ranges now, instead of on first sight.

        Runs the model once per combination of dim values (``dims`` narrows them) on zero
        inputs (bound inputs, see ``bind_inputs``, as they are); returns the seconds it took.
        Shapes already recorded are replayed, not recorded again.
        """
        if self.signature is None:
            raise ValueError("record_all needs the model's signature (load it from an artifact)")
        unknown = sorted(set(dims or ()) - set(self.signature.dims))
        if unknown:
            raise InputError(f"record_all: {unknown} are not dimensions of the model; its "
                             f"dimensions are {sorted(self.signature.dims)}")
        values = {name: list(dims[name]) if dims and name in dims else list(rng)
                  for name, rng in self.signature.dims.items()}
        combos = list(itertools.product(*values.values()))
        bar = Progress(len(combos), "grape-tvm: recording shapes", enabled=progress)
        for combo in combos:
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
            self._buffer_of.clear()
            self._bound.clear()
            self._template = [None] * len(self._template)
            self._returned, self._dims_of = {}, {}
            self.stats.plans_held = self.stats.shapes_held = 0

    def _check_open(self) -> None:
        if self._vm is None:
            raise RuntimeError("this executor is closed")

    def __enter__(self) -> "GraphExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
    tuple too (``tvm_ffi.Shape``): it is one output, not several; so is the tuple a model
    with one sequence output returns."""
    if isinstance(result, (tvm.runtime.Tensor, tvm_ffi.Shape)):
        return [result]
    if signature is not None and len(signature.outputs) == 1 and \
            signature.outputs[0].kind == "sequence":
        return [list(result)]
    return list(result)


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


def default_backend(device: tvm.runtime.Device, max_shapes: int | None = None):
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


def _share_memory(tensors: Sequence[Any]) -> bool:
    """Whether two of ``tensors`` (tensors and other values) overlap in memory."""
    spans = sorted((t.data_ptr(), t.data_ptr() + nbytes(t))
                   for t in tensors if isinstance(t, tvm.runtime.Tensor) and nbytes(t))
    return any(start < end for (_, end), (start, _) in zip(spans, spans[1:]))


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
