"""``GraphExecutor``: host steps through TVM's VM, regions through recorded graphs."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine, VMInstrumentReturnKind

from .call_plan import BufferPool, CallPlan, CallPlanRecorder
from .progress import Progress
from .signature import InputError, Signature

REGION_PREFIX = "grape_region_"  # the names LiftGraphRegions gives region functions


@dataclass
class CallStats:
    """What the executor did, summed over calls."""

    calls: int = 0
    region_replays: int = 0
    region_recordings: int = 0
    planned_calls: int = 0  # calls that ran without the VM
    recordings_by_region: dict[str, int] = field(default_factory=dict)


class GraphExecutor:
    """Run a grape-compiled module on one device.

    The VM runs the entry function; each call of a region function is intercepted: at a
    shape seen before the backend replays it (one graph launch on CUDA) and the VM skips the
    call; at a new shape the VM runs it while the backend records it. Returned
    arrays are new numpy arrays, or with ``return_numpy=False`` tensors that the executor's
    VM allocated for this call.

    Calls are serialized: one executor has one VM and one stream; use one executor per
    thread for parallel calls.
    """

    def __init__(self, executable: tvm.runtime.Module, device: tvm.runtime.Device,
                 signature: Signature | None = None, backend=None, entry: str = "main",
                 plan_calls: bool = False):
        self.device = device
        self.signature = signature
        self.backend = backend if backend is not None else default_backend(device)
        self.entry = entry
        self.stats = CallStats()
        self._vm = VirtualMachine(executable, device)
        self._vm.set_instrument(self._instrument)
        self._open: tuple[str, Any] | None = None  # (region, recorder) while recording
        self._lock = threading.Lock()
        # Calls without the VM: only for an entry function with no host step (see call_plan).
        self._plan_calls = plan_calls and signature is not None
        self._plans: dict[tuple, CallPlan | None] = {}
        self._watch: CallPlanRecorder | None = None
        self._pool = BufferPool(device)
        self._buffer_of: dict[tuple, int] = {}
        self._bound: dict[str, tvm.runtime.Tensor] = {}
        self._bound_dims: dict[str, int] = {}
        inputs = signature.inputs if signature is not None else ()
        self._position = {t.name: i for i, t in enumerate(inputs)}
        self._template: list[Any] = [None] * len(inputs)  # bound inputs in place

    # -- calls ---------------------------------------------------------------------------
    def bind_inputs(self, inputs: Mapping[str, Any]) -> None:
        """Fix inputs that do not change from call to call (weights): checked and moved to
        the device once, then left out of ``run``'s inputs."""
        if self.signature is None:
            raise ValueError("bind_inputs needs the model's signature (load it from an artifact)")
        with self._lock:
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
            self._plans.clear()

    def run(self, inputs: Mapping[str, Any] | Sequence[Any], *,
            return_numpy: bool = True) -> dict[str, Any] | list[Any]:
        """Run one call; ``inputs`` maps input names to numpy arrays or DLPack tensors.

        Returned tensors (``return_numpy=False``) belong to the executor and stay valid until
        its next call. Without a signature (an executable straight from ``tvm.compile``)
        inputs are positional and outputs come back as a list.
        """
        with self._lock:
            args, key, passed = self._prepare(inputs)
            try:
                with self.backend.stream_context():
                    outputs = self._call(args, key, passed)
                    if return_numpy:
                        outputs = _to_numpy(outputs)
            except BaseException:
                self._abandon_recording()
                raise
            self.stats.calls += 1
            return outputs

    __call__ = run

    def _call(self, args: list, key: tuple | None, passed: list):
        plan = self._plans.get(key) if key is not None else None
        if plan is not None and not self._aliases_pool(passed):
            outputs = plan.run(args, self._pool, self.backend)
            if outputs is not None:
                self.stats.planned_calls += 1
                self.stats.region_replays += len(plan.regions)
                return self._name_outputs(outputs)
        watch = self._plan_calls and key is not None and key not in self._plans
        fixed = [i for i, t in enumerate(self._template) if t is not None]
        self._watch = CallPlanRecorder(args, fixed) if watch else None
        try:
            result = self._vm[self.entry](*args)
        finally:
            recorder, self._watch = self._watch, None
        outputs = self._name_outputs(result)
        if recorder is not None:
            values = list(outputs.values()) if isinstance(outputs, dict) else outputs
            self._plans[key] = recorder.finish(values, self._pool, self._buffer_of)
        return outputs

    def _aliases_pool(self, passed: list) -> bool:
        """An input living in the executor's buffers (last call's output fed back) would be
        overwritten while read: such a call takes the VM."""
        spans = self._pool.spans()
        for tensor in passed:
            address = tensor.data_ptr()
            if any(start <= address < start + size for start, size in spans):
                return True
        return False

    def _prepare(self, inputs) -> tuple[list[tvm.runtime.Tensor], tuple | None, list]:
        """The entry function's arguments, the call's dims key, and the tensors passed."""
        if self.signature is None:
            args = [self._as_tensor(f"#{i}", v) for i, v in enumerate(inputs)]
            return args, None, args
        if not isinstance(inputs, Mapping):
            raise TypeError(f"inputs must be a mapping from input name to array, got "
                            f"{type(inputs).__name__}")
        tensors = {name: self._as_tensor(name, value) for name, value in inputs.items()}
        dims = self.signature.bind({k: t.shape for k, t in tensors.items()},
                                   {k: str(t.dtype) for k, t in tensors.items()},
                                   bound=self._bound_dims, skip=self._bound)
        args = list(self._template)
        for name, tensor in tensors.items():
            args[self._position[name]] = tensor
        return args, tuple(sorted(dims.items())), list(tensors.values())

    def _as_tensor(self, name: str, value: Any) -> tvm.runtime.Tensor:
        if isinstance(value, tvm.runtime.Tensor):
            tensor = value
        elif isinstance(value, np.ndarray) or np.isscalar(value):
            return tvm.runtime.tensor(np.ascontiguousarray(value), self.device)
        elif hasattr(value, "__dlpack__"):
            tensor = tvm.runtime.from_dlpack(value)
        else:
            raise TypeError(f"input {name!r}: expected a numpy array or a DLPack tensor, got "
                            f"{type(value).__name__}")
        if tensor.device.dlpack_device_type() != self.device.dlpack_device_type() or \
                tensor.device.index != self.device.index:
            raise ValueError(f"input {name!r} is on {tensor.device}, the executor runs on "
                             f"{self.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"input {name!r} is not contiguous (strides {tensor.strides}); "
                             "the kernels read dense row-major tensors")
        return tensor

    def _name_outputs(self, result: Any) -> dict[str, tvm.runtime.Tensor] | list:
        values = list(result) if not isinstance(result, tvm.runtime.Tensor) else [result]
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

    # -- region interception -------------------------------------------------------------
    def _instrument(self, func, symbol: str, before_run: bool, _ret, *args) -> int:
        if self._open is not None:
            return self._while_recording(func, symbol, before_run, args)
        if before_run and symbol.startswith(REGION_PREFIX):
            shape = tuple(int(v) for v in args[-1])
            if self._watch is not None:
                self._watch.on_region(symbol, shape, args[:-1])
            if self.backend.replay(symbol, shape, args[:-1]):
                self.stats.region_replays += 1
                return VMInstrumentReturnKind.SKIP_RUN
            self._open = (symbol, self.backend.begin(symbol, shape, args[:-1]))
        return VMInstrumentReturnKind.NO_OP

    def _while_recording(self, func, symbol: str, before_run: bool, args) -> int:
        region, recorder = self._open
        if symbol == region and not before_run:
            self._open = None
            self.backend.end(recorder)
            self.stats.region_recordings += 1
            self.stats.recordings_by_region[region] = self.stats.recordings_by_region.get(region, 0) + 1
        elif before_run:
            recorder.on_call(func, symbol, args)
        return VMInstrumentReturnKind.NO_OP

    # -- recording ahead of time ----------------------------------------------------------
    def record_all(self, dims: Mapping[str, Sequence[int]] | None = None, *,
                   fixed: Mapping[str, Any] | None = None, progress: bool = True) -> float:
        """Record every shape of the declared ranges now, instead of on first sight.

        Runs the model once per combination of dim values (``dims`` narrows them) on zero
        inputs, or on ``fixed`` ones for inputs whose shape never changes (weights); returns
        the seconds it took. Shapes already recorded are replayed, not recorded again.
        """
        if self.signature is None:
            raise ValueError("record_all needs the model's signature (load it from an artifact)")
        values = {name: list(dims[name]) if dims and name in dims else list(rng)
                  for name, rng in self.signature.dims.items()}
        combos = list(itertools.product(*values.values()))
        bar = Progress(len(combos), "grape-tvm: recording shapes", enabled=progress)
        for combo in combos:
            bound = dict(zip(values, combo))
            self.run({spec.name: fixed[spec.name] if fixed and spec.name in fixed else
                      np.zeros([bound[d] if isinstance(d, str) else d for d in spec.shape],
                               spec.dtype)
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
        """Free every graph and stream this executor holds."""
        self.backend.close()

    def __enter__(self) -> "GraphExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _to_numpy(outputs):
    if isinstance(outputs, dict):
        return {k: v.numpy() for k, v in outputs.items()}
    return [v.numpy() for v in outputs]


def default_backend(device: tvm.runtime.Device):
    """CUDA graphs on a CUDA device, CPU replay on the CPU."""
    if device.dlpack_device_type() == tvm.cuda(0).dlpack_device_type():
        from .cuda_backend import CudaGraphBackend  # pylint: disable=import-outside-toplevel

        return CudaGraphBackend(device)
    from .cpu_replay import CpuReplayBackend  # pylint: disable=import-outside-toplevel

    return CpuReplayBackend(device)
