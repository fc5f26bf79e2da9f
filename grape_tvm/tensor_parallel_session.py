"""A tensor-parallel artifact run on its ranks: one disco worker per device, grape's executor
on each.

``grape_tvm.build(..., tensor_parallel=N)`` writes one artifact holding the program every
rank runs and the shard plan (``plan["tensor_parallel"]``). ``TensorParallelSession``
starts a disco session of N workers (processes, one per GPU; or threads), initializes its
collectives (NCCL) and has every worker load the artifact with grape's executor on the
device disco gave it. Inputs come whole, as one device would take them, checked here first:
each rank gets its part of those the shard plan splits (disco's scatter from worker 0) and
the others whole (its broadcast). A call runs the rank's program on every worker, its
all-reduces through the session's collectives, and returns the outputs whole, as one device
would: one the ranks hold whole (after an all-reduce) is rank 0's, one they hold in parts
(a KV cache split by heads) is gathered to rank 0 and joined, so it can be fed back.

    with grape_tvm.load_tensor_parallel("step.grape", devices=[0, 1]) as ranks:
        ranks.bind_inputs(weights)             # whole arrays; each rank keeps its part
        outputs = ranks.run({"x": x, ...})     # whole, as numpy

Importing this module registers the ``grape.rank.*`` functions the workers run: the
controller's own (a threaded session's workers, and a process session's worker 0) and, in a
process session, each other worker's through its entrypoint (``grape_tvm.rank_worker``).
A worker's error comes back as ``RankError``: disco ends the process on an exception in a
worker, so the functions return it instead.

With NCCL, ``NCCL_NVLS_ENABLE`` is set to 0 before the workers start where the host left it
unset (NVLink multicast stays off); the rest of the host's NCCL environment is the workers'.
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import tvm

from grape_tvm.artifact import Artifact, ArtifactError
from grape_tvm.runtime.signature import InputError, Signature
from grape_tvm.runtime.tensor_parallel import OUTPUTS_KEY, PLAN_KEY, joined, rank_part

NVLS_ENV = "NCCL_NVLS_ENABLE"
WORKER_ENTRYPOINT = "grape_tvm.rank_worker"  # a process session's workers: python -m this
CCLS = ("nccl",)
ERROR_PREFIX = "grape.rank error: "  # a worker function's result when it raised
_FUNCTIONS = ("load", "run", "output", "output_shapes", "status")


class RankError(RuntimeError):
    """A worker of a tensor-parallel session failed; the message says which and why."""


def load_disco():
    """``tvm.runtime.disco`` with its FFI functions registered: ``import tvm`` sets the
    attribute to None when disco's library is not loaded yet, and leaves the functions out
    (docs/design.md), so the module is imported by name."""
    import importlib  # pylint: disable=import-outside-toplevel

    import tvm_ffi  # pylint: disable=import-outside-toplevel

    disco = importlib.import_module("tvm.runtime.disco")
    api = importlib.import_module("tvm.runtime.disco._ffi_api")
    if not hasattr(api, "SessionThreaded"):
        tvm_ffi.init_ffi_api("runtime.disco", api.__name__)
    return disco


def _keep_nvlink_multicast_off() -> None:
    value = os.environ.get(NVLS_ENV)
    if value is None:
        os.environ[NVLS_ENV] = "0"  # before the workers start: they inherit it
    elif value != "0":
        raise ValueError(f"{NVLS_ENV} is {value!r}: a tensor-parallel session keeps NVLink "
                         "multicast off; unset it or set it to 0")


class TensorParallelSession:
    """The ranks of one tensor-parallel artifact, each a disco worker running grape's
    executor on its device. Owns the session; the workers' executors live as long as it
    does (``close``, or when it is collected)."""

    def __init__(self, path: str | Path, devices: Sequence[int] | None = None, *,
                 threaded: bool = False, ccl: str | None = "nccl",
                 graph_mode: str = "topology"):
        self.session = None  # what close() frees, set before anything can fail
        self._functions: dict[str, Any] = {}
        self._executor = None
        self._threaded = threaded
        self._lock = threading.Lock()  # one call at a time: disco's commands must not interleave
        manifest = Artifact.load(path).manifest
        parallel = manifest["plan"].get(PLAN_KEY)
        if parallel is None:
            raise ArtifactError(f"{path} is built for one device (its plan has no "
                                f"{PLAN_KEY!r}): load it with grape_tvm.load")
        self.world_size = int(parallel["world_size"])
        self.shard_plan = {str(k): int(v) for k, v in parallel["shard_plan"].items()}
        self.output_shard_plan = {str(k): int(v) for k, v in parallel[OUTPUTS_KEY].items()}
        self.signature = Signature.from_json(manifest["signature"])  # a rank's program's
        self._bound: set[str] = set()  # inputs bound (bind_inputs) and the dims they set
        self._bound_dims: dict[str, int] = {}
        devices = list(range(self.world_size)) if devices is None else list(devices)
        if len(devices) != self.world_size or len(set(devices)) != len(devices):
            raise ValueError(f"{path} runs on {self.world_size} distinct devices, got "
                             f"{devices}")
        if ccl is not None and ccl not in CCLS:
            raise ValueError(f"ccl must be one of {CCLS} or None, got {ccl!r}")
        disco = load_disco()
        if ccl is not None:
            if tvm.get_global_func(f"runtime.disco.{ccl}.init_ccl", allow_missing=True) is None:
                raise RuntimeError(f"this TVM has no {ccl} collectives for disco "
                                   f"(runtime.disco.{ccl}.init_ccl): a tensor-parallel run on "
                                   "GPUs needs a TVM built with them (the pip wheel of 0.27 "
                                   "has none)")
            _keep_nvlink_multicast_off()
        self.session = disco.ThreadedSession(self.world_size) if threaded else \
            disco.ProcessSession(self.world_size, entrypoint=WORKER_ENTRYPOINT)
        _OPEN.add(self)
        try:
            if ccl is not None:
                self.session.init_ccl(ccl, *devices)
            self._functions = {name: self.session.get_global_func(f"grape.rank.{name}")
                               for name in _FUNCTIONS}
            kind = "cuda" if manifest["target"]["kind"] == "cuda" else "cpu"
            self._executor = self._call("load", str(Path(path).resolve()), kind, graph_mode)
            self._raise_failed(self._executor)
        except BaseException:
            self.close()
            raise

    # -- calls ---------------------------------------------------------------------------
    def bind_inputs(self, inputs: Mapping[str, Any]) -> None:
        """Bind inputs that stay the same across calls (weights), given whole: every rank
        keeps its part (``GraphExecutor.bind_inputs``)."""
        with self._lock:
            dims = self._checked(inputs, partial=True)
            done = self._call("run", self._executor, "bind", *self._send(inputs))
            self._raise_failed(done)
            self._bound |= set(inputs)
            self._bound_dims.update(dims)

    def run(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """One call on every rank, inputs whole; the outputs whole, as one device's: those
        the ranks hold in parts gathered to rank 0 and joined (``output_shard_plan``)."""
        with self._lock:
            return self._run(inputs)

    def _run(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        self._checked(inputs, partial=False)
        outputs = self._call("run", self._executor, "run", *self._send(inputs))
        self._raise_failed(outputs)  # every rank: one that failed must not gather
        flat = list(self._call("output_shapes", outputs).debug_get_from_remote(0))
        hosts = {}
        for i, spec in enumerate(self.signature.outputs):
            shape, flat = tuple(flat[1:1 + flat[0]]), flat[1 + flat[0]:]
            output = self._call("output", outputs, i)
            if spec.name in self.output_shard_plan:  # every rank's slice, stacked on rank 0
                shape = (self.world_size, *shape)
                stacked = self.session.empty(shape, spec.dtype, worker0_only=True)
                self.session.gather_to_worker0(output, stacked)
                output = stacked
            hosts[spec.name] = tvm.runtime.empty(shape, spec.dtype)
            self.session.copy_from_worker_0(hosts[spec.name], output)
        self.session.sync_worker_0()
        return {name: joined(host.numpy(), self.output_shard_plan[name])
                if name in self.output_shard_plan else host.numpy()
                for name, host in hosts.items()}

    def _checked(self, inputs: Mapping[str, Any], partial: bool) -> dict[str, int]:
        """The dims the inputs set, their rank 0 parts checked as the rank's executor will
        check them (names, dtypes, shapes, dims), before anything is sent: a worker's failure
        on bad input would leave the others waiting in a collective."""
        self._check_open()
        parts = {name: self._part(name, np.asarray(value)) for name, value in inputs.items()}
        return self.signature.bind({k: v.shape for k, v in parts.items()},
                                   {k: str(v.dtype) for k, v in parts.items()},
                                   bound=self._bound_dims, skip=self._bound, partial=partial)

    def _part(self, name: str, value: np.ndarray) -> np.ndarray:
        """Rank 0's part of a whole input; ``InputError`` where the plan's split cannot be."""
        axis = self.shard_plan.get(name)
        if axis is None:
            return value
        if value.ndim <= axis or value.shape[axis] % self.world_size:
            raise InputError(f"input {name!r} of shape {value.shape} is split across "
                             f"{self.world_size} ranks along axis {axis}: its size there must "
                             f"be a multiple of {self.world_size}")
        return rank_part(name, value, axis, 0, self.world_size)

    def _send(self, inputs: Mapping[str, Any]) -> list:
        """The names, then each input on the ranks (its part where the plan splits it)."""
        names = list(inputs)
        if any("," in name for name in names):
            raise ValueError(f"input names with a comma cannot be sent to the ranks: {names}")
        sent = []
        for name in names:
            value = np.ascontiguousarray(inputs[name])
            axis = self.shard_plan.get(name)
            sent.append(self.session.broadcast(value) if axis is None else self.session.scatter(
                np.stack([rank_part(name, value, axis, r, self.world_size)
                          for r in range(self.world_size)])))
        return [",".join(names), *sent]

    def _call(self, name: str, *args):
        return self.session.call_packed(self._functions[name], *args)

    def _raise_failed(self, result) -> None:
        """Raise ``RankError`` if a worker function's ``result`` is an error on any rank
        (a round trip to each)."""
        status = self._call("status", result)
        for worker in range(self.world_size):
            message = status.debug_get_from_remote(worker)
            if message:
                raise RankError(f"rank {worker}: {message}")

    def _check_open(self) -> None:
        if self.session is None:
            raise RuntimeError("the tensor-parallel session is closed")

    # -- ownership -----------------------------------------------------------------------
    def close(self) -> None:
        """Free the workers' executors and end the session; closing twice is harmless.

        A process session is ended by dropping its last reference, not ``shutdown()``: its
        references still alive after ``shutdown`` (the ones this object and disco's own cache
        hold) would each write to the exited workers when freed, which ends this process.
        Freed together, the session shuts its workers down once (reaping them needs
        ``psutil``, which TVM looks for). A threaded session's threads end with
        ``shutdown()`` (freed without it, it waits for them)."""
        session, self.session = self.session, None
        if session is None:
            return
        _OPEN.discard(self)
        try:
            if self._executor is not None:
                session.call_packed(self._functions["run"], self._executor, "close", "")
                session._sync_all()  # pylint: disable=protected-access
        finally:
            self._executor = None
            self._functions = {}
            if self._threaded:
                session.shutdown()
            for cached in ("_cache", "_import_python_module"):
                if hasattr(session, cached):
                    delattr(session, cached)
            del session

    def __del__(self):
        if sys.is_finalizing():  # too late: the workers cannot take Python's lock (_close_open)
            return
        try:
            self.close()
        except Exception:  # pylint: disable=broad-except
            pass

    def __enter__(self) -> "TensorParallelSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# Sessions not closed yet, closed at exit while Python can still run the workers' functions
# (at finalization a worker waits for Python's lock forever and the process aborts).
_OPEN: "weakref.WeakSet[TensorParallelSession]" = weakref.WeakSet()


@atexit.register
def _close_open() -> None:
    for session in list(_OPEN):
        session.close()


def load_tensor_parallel(path: str | Path, devices: Sequence[int] | None = None,
                         **options: Any) -> TensorParallelSession:
    """A tensor-parallel artifact on ``devices`` (default ``0..N-1``): see
    ``TensorParallelSession``."""
    return TensorParallelSession(path, devices, **options)


# -- what each worker runs -------------------------------------------------------------------
def _error(err: BaseException) -> str:
    return f"{ERROR_PREFIX}{type(err).__name__}: {err}"


def _worker_device(kind: str) -> str:
    """The device disco gave this worker (after NCCL's initialization: the session's
    ``devices[worker]``); the CPU for a CPU artifact."""
    if kind == "cpu":
        return "cpu"
    device = tvm.get_global_func("runtime.disco.device")()
    if device.dlpack_device_type() != tvm.cuda(0).dlpack_device_type():
        raise RuntimeError(f"this worker's device is {device}, and the artifact runs on CUDA: "
                           "a CUDA session needs its collectives initialized (ccl)")
    return f"cuda:{device.index}"


# The executors of this process's workers, by handle: a threaded session's workers are
# threads of one process (each handle is one worker's). Handles, not the executors
# themselves, travel in disco's references: a reference freed while a worker holds Python's
# lock would wait for it (a process session's worker 0 is a thread of the controller).
_EXECUTORS: dict[int, Any] = {}
_HANDLES = itertools.count(1)
_LOCK = threading.Lock()


def _collectives_done() -> None:
    """Wait for this worker's collectives: NCCL's stream where disco has it, else the
    device."""
    sync = tvm.get_global_func("runtime.disco.nccl.sync_worker", allow_missing=True)
    if sync is not None:
        sync()
    else:
        tvm.get_global_func("runtime.disco.device")().sync()


@tvm.register_global_func("grape.rank.load", override=True)
def _load(path: str, kind: str, graph_mode: str):
    """A handle of this worker's executor of ``path``, or the error as a string."""
    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    try:
        executor = load(path, _worker_device(kind), graph_mode=graph_mode)
    except Exception as err:  # pylint: disable=broad-except
        return _error(err)
    with _LOCK:
        handle = next(_HANDLES)
        _EXECUTORS[handle] = executor
    return handle


@tvm.register_global_func("grape.rank.run", override=True)
def _run(handle, action: str, names: str, *tensors):
    """``action`` on the executor of ``handle``: "bind" or "run" the named tensors, or
    "close" it. The outputs of a run; "" for the others; the error as a string."""
    if isinstance(handle, str):  # its load failed: that error again
        return handle
    try:
        if action == "close":
            with _LOCK:
                executor = _EXECUTORS.pop(handle, None)
            if executor is not None:
                executor.close()
            return ""
        executor = _EXECUTORS[handle]
        named = dict(zip(names.split(","), tensors)) if names else {}
        on_gpu = executor.device.dlpack_device_type() != tvm.cpu(0).dlpack_device_type()
        if named and on_gpu:
            _collectives_done()  # they sent the inputs on a stream of their own
        if action == "bind":
            executor.bind_inputs(named)
            return ""
        outputs = list(executor.run(named, return_numpy=False).values())
        if on_gpu:  # the gather of the outputs runs on the collectives' stream
            executor.backend.synchronize()
        return outputs
    except Exception as err:  # pylint: disable=broad-except
        return _error(err)


@tvm.register_global_func("grape.rank.status", override=True)
def _status(result) -> str:
    """A worker function's error message, or "" if it succeeded."""
    return result[len(ERROR_PREFIX):] if isinstance(result, str) and \
        result.startswith(ERROR_PREFIX) else ""


@tvm.register_global_func("grape.rank.output", override=True)
def _output(outputs, index: int):
    """Output ``index`` of a run (None if the run failed: the controller raises first)."""
    return None if isinstance(outputs, str) else outputs[index]


@tvm.register_global_func("grape.rank.output_shapes", override=True)
def _output_shapes(outputs):
    """Every output's rank, then its dims, in one tuple (one read for all of them)."""
    flat = []
    for output in [] if isinstance(outputs, str) else outputs:
        flat += [len(output.shape), *output.shape]
    return tvm.runtime.ShapeTuple(flat)
