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

A decode loop keeps each rank's part of its caches on that rank between calls: ``run``'s
``feed_back`` names the outputs to keep and the inputs they become on the next call, which
then leaves those inputs out (``KeptOutput``)::

    keep = {"present_k0": "past_k0", "present_v0": "past_v0"}
    ranks.run({"x": x, "past_k0": k, "past_v0": v}, feed_back=keep)   # y; caches kept
    ranks.run({"x": x2}, feed_back=keep)       # reads the kept caches where they are

An artifact of ``compile_loop(..., tensor_parallel=N)`` runs its whole loop on every rank
(``run_loop``): each rank's loop (``grape_tvm.loop.loop_runner``) steps on its part of the
state, and the final state comes back whole.

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
import json
import os
import sys
import threading
import weakref
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import tvm

from grape_tvm.artifact import Artifact, ArtifactError, stored_weights
from grape_tvm.runtime.cuda_driver import copy_part
from grape_tvm.runtime.device_loop import LoopResult, LoopSpec
from grape_tvm.runtime.nccl import CollectiveFunction, CollectiveGroup, unique_id
from grape_tvm.runtime.signature import BoundDims, InputError, Signature
from grape_tvm.runtime.tensor_parallel import (OUTPUTS_KEY, PLAN_KEY, joined, placement_text,
                                               rank_part)

NVLS_ENV = "NCCL_NVLS_ENABLE"
WORKER_ENTRYPOINT = "grape_tvm.rank_worker"  # a process session's workers: python -m this
CCLS = ("nccl",)
ERROR_PREFIX = "grape.rank error: "  # a worker function's result when it raised
_FUNCTIONS = ("load", "join", "run", "receive", "gather", "output", "output_shapes", "status",
              "describe", "load_loop", "run_loop", "steps", "close_loop")


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


@dataclass
class KeptOutput:
    """An output a call left on the ranks as the next call's input (``run``'s
    ``feed_back``): ``parts`` refers to every rank's part, the tensor its executor returned,
    read in place by the next call (the executor writes that call's outputs beside its
    inputs: ``BufferPool``). Its session owns it: dropping ``parts`` frees the parts."""

    parts: Any  # a disco DRef: each worker's tensor
    part_shape: tuple[int, ...]  # on one rank
    dtype: str


class TensorParallelSession:
    """The ranks of one tensor-parallel artifact, each a disco worker running grape's
    executor on its device. Owns the session; the workers' executors, their loops and the
    outputs kept on them live as long as it does (``close``, or when it is collected)."""

    def __init__(self, path: str | Path, devices: Sequence[int] | None = None, *,
                 threaded: bool = False, ccl: str | None = "nccl",
                 graph_mode: str | None = None, loop_mode: str = "auto"):
        self.session = None  # what close() frees, set before anything can fail
        self._functions: dict[str, Any] = {}
        self._executor = None
        self._transport: _DiscoTransport | _NcclTransport | None = None
        self._loop = None  # each worker's loop runner (an artifact of compile_loop)
        self._kept: dict[str, KeptOutput] = {}  # by the input each one is next
        self._feed_back_checked: tuple | None = None  # the last (feed_back, gather) accepted
        self._threaded = threaded
        self._lock = threading.Lock()  # one call at a time: disco's commands must not interleave
        artifact = Artifact.load(path)
        manifest = artifact.manifest
        parallel = manifest["plan"].get(PLAN_KEY)
        if parallel is None:
            raise ArtifactError(f"{path} is built for one device (its plan has no "
                                f"{PLAN_KEY!r}): load it with grape_tvm.load")
        self.world_size = int(parallel["world_size"])
        self.shard_plan = {str(k): int(v) for k, v in parallel["shard_plan"].items()}
        self.output_shard_plan = {str(k): int(v) for k, v in parallel[OUTPUTS_KEY].items()}
        self.signature = Signature.from_json(manifest["signature"])  # a rank's program's
        self.loop_spec = LoopSpec.from_json(manifest["loop"]) if "loop" in manifest else None
        self._bound: set[str] = set()  # inputs bound (bind_inputs) and the dims they set
        self._bound_dims = BoundDims()
        devices = list(range(self.world_size)) if devices is None else list(devices)
        if len(devices) != self.world_size or len(set(devices)) != len(devices):
            raise ValueError(f"{path} runs on {self.world_size} distinct devices, got "
                             f"{devices}")
        if ccl is not None and ccl not in CCLS:
            raise ValueError(f"ccl must be one of {CCLS} or None, got {ccl!r}")
        kind = "cuda" if manifest["target"]["kind"] == "cuda" else "cpu"
        if graph_mode is None:
            # NCCL's kernels of several ranks have not run in a topology graph (their
            # parameters patched from one shape's capture into another's graph): until
            # they have, a CUDA rank keeps one graph per shape unless asked.
            graph_mode = "per-shape" if kind == "cuda" else "topology"
        disco = load_disco()
        group_id = ""  # NCCL's unique id, made here for every rank of a CUDA artifact
        if kind == "cuda":
            if ccl != "nccl":
                raise ValueError(f"{path} runs on CUDA: its ranks talk through NCCL "
                                 f"(ccl='nccl'), got ccl={ccl!r}")
            _keep_nvlink_multicast_off()
            group_id = unique_id().hex()
        elif ccl is not None:
            if tvm.get_global_func(f"runtime.disco.{ccl}.init_ccl", allow_missing=True) is None:
                raise RuntimeError(f"this TVM has no {ccl} collectives for disco "
                                   f"(runtime.disco.{ccl}.init_ccl) to run a CPU artifact's "
                                   "ranks with")
        self.session = disco.ThreadedSession(self.world_size) if threaded else \
            disco.ProcessSession(self.world_size, entrypoint=WORKER_ENTRYPOINT)
        _OPEN.add(self)
        try:
            if ccl is not None and kind == "cpu":
                self.session.init_ccl(ccl, *devices)
            self._functions = {name: self.session.get_global_func(f"grape.rank.{name}")
                               for name in _FUNCTIONS}
            self._executor = self._call("load", str(Path(path).resolve()), graph_mode,
                                        ",".join(map(str, devices)) if kind == "cuda" else "")
            self._raise_failed(self._executor)
            if group_id:  # every rank loaded: now they join NCCL's group, all at once
                self._raise_failed(self._call("join", self._executor, len(devices), group_id))
            self._transport = _NcclTransport(self) if kind == "cuda" else \
                _DiscoTransport(self, path, ccl)
            stored = stored_weights(artifact, parallel.get("weights", ()))
            if stored:  # the whole weights the artifact carries: each rank keeps its part
                self.bind_inputs(stored)
            if self.loop_spec is not None:
                self._loop = self._call("load_loop", self._executor, str(Path(path).resolve()),
                                        loop_mode)
                self._raise_failed(self._loop)
        except BaseException:
            self.close()
            raise

    # -- calls ---------------------------------------------------------------------------
    def bind_inputs(self, inputs: Mapping[str, Any]) -> None:
        """Bind inputs that stay the same across calls (weights), given whole: every rank
        keeps its part (``GraphExecutor.bind_inputs``)."""
        with self._lock:
            kept = sorted(set(inputs) & set(self._kept))
            if kept:
                raise InputError(f"input(s) {kept} are kept on the ranks from the last call "
                                 "(feed_back): drop_kept() them before binding them")
            self._check_open()
            shapes, dtypes = self._part_specs(inputs)
            bound_dims = self._bound_dims.binding(self.signature, shapes, dtypes)  # kept below
            done = self._call("run", self._executor, "bind", *self._send(inputs))
            self._raise_failed(done)
            self._bound |= set(inputs)
            self._bound_dims = bound_dims
            self._feed_back_checked = None  # a bound input cannot be fed back

    def run(self, inputs: Mapping[str, Any], *, feed_back: Mapping[str, str] | None = None,
            gather: Collection[str] = ()) -> dict[str, np.ndarray]:
        """One call on every rank, inputs whole; the outputs whole, as one device's: those
        the ranks hold in parts gathered to rank 0 and joined (``output_shard_plan``).

        ``feed_back`` maps outputs to inputs: each output it names stays on every rank,
        as that rank's part (or whole, where the ranks hold it whole), and is the next
        call's input of that name; it is not returned unless ``gather`` names it. The next
        call reads a kept input where it is when ``inputs`` leave it out, and drops it when
        ``inputs`` give it (the value given replaces it); what it keeps after is what its
        own ``feed_back`` names. A call that raises keeps what was kept."""
        with self._lock:
            return self._run(inputs, dict(feed_back or {}), gather)

    def describe(self) -> list[dict]:
        """Every rank's backend, as its executor describes it (``backend.describe()``: its
        graphs, their device memory, ...), in rank order."""
        with self._lock:
            self._check_open()
            described = self._call("describe", self._executor)
            self._raise_failed(described)
            return [json.loads(described.debug_get_from_remote(worker))
                    for worker in range(self.world_size)]

    @property
    def kept(self) -> dict[str, tuple[int, ...]]:
        """The inputs kept on the ranks for the next call, with their whole shapes."""
        return {name: self._whole_shape(name, kept.part_shape)
                for name, kept in self._kept.items()}

    def drop_kept(self, names: Collection[str] | None = None) -> None:
        """Free what is kept on the ranks for the named inputs (all of them by default);
        the next call must then pass those inputs."""
        with self._lock:
            names = list(self._kept) if names is None else list(names)
            unknown = [name for name in names if name not in self._kept]
            if unknown:  # before any is dropped
                raise KeyError(f"no output is kept for input(s) {unknown}; kept: "
                               f"{sorted(self._kept)}")
            for name in names:
                del self._kept[name]  # its reference frees every rank's part

    def run_loop(self, state: Mapping[str, Any], max_steps: int | None = None) -> LoopResult:
        """Run the loop of a ``compile_loop(..., tensor_parallel=N)`` artifact from
        ``state`` (whole, as one device's; the invariants bound with ``bind_inputs``)
        until its stop flag is set or ``max_steps`` steps ran (the compiled default). Each
        rank runs its loop (``HostLoop``; ``DeviceLoop``, one graph launch, on CUDA) on its
        part of the state, which stays on it from step to step; the final state comes back
        whole. Every rank stops at the same step: ``stop`` is replicated (``compile_loop``
        refuses one split across the ranks), and the steps each rank ran are compared."""
        with self._lock:
            self._check_open()
            spec = self.loop_spec
            if spec is None:
                raise ValueError("this artifact has no loop: it was not compiled by "
                                 "compile_loop")
            if self._kept:
                raise InputError(f"outputs are kept on the ranks for {sorted(self._kept)}: "
                                 "the loop's steps would write over them; drop_kept() first")
            if set(state) != set(spec.carried):
                raise InputError(f"the loop state is {list(spec.carried)}, got {sorted(state)} "
                                 "(loop invariants are bound with bind_inputs)")
            limit = spec.limit(max_steps)
            self._checked(state)
            result = self._call("run_loop", self._loop, limit, *self._send(state))
            self._raise_failed(result)
            steps = self._steps_run(result)
            dtypes = {out.name: out.dtype for out in self.signature.outputs}
            final = self._gathered(result, self._part_shapes(result),
                                   [(i, name, dtypes[name]) for i, name in enumerate(spec.carried)])
            return LoopResult(final, steps)

    def _run(self, inputs: Mapping[str, Any], feed_back: dict[str, str],
             gather: Collection[str]) -> dict[str, np.ndarray]:
        self._check_open()
        self._check_feed_back(feed_back, gather)
        kept = {name: k for name, k in self._kept.items() if name not in inputs}
        self._checked(inputs, kept=kept)
        outputs = self._call("run", self._executor, "run", *self._send(inputs, kept))
        self._raise_failed(outputs)  # every rank: one that failed must not gather
        shapes = self._part_shapes(outputs)
        # What was kept was this call's input, now used up (or replaced); the outputs kept
        # from this call were written beside it, never over it.
        self._kept = {feed_back[out.name]: KeptOutput(self._call("output", outputs, i),
                                                      shapes[i], out.dtype)
                      for i, out in enumerate(self.signature.outputs) if out.name in feed_back}
        return self._gathered(outputs, shapes, [
            (i, out.name, out.dtype) for i, out in enumerate(self.signature.outputs)
            if out.name not in feed_back or out.name in gather])

    def _part_shapes(self, result) -> list[tuple[int, ...]]:
        """The shape on a rank of each tensor a worker function returned (rank 0's)."""
        flat, shapes = list(self._call("output_shapes", result).debug_get_from_remote(0)), []
        while flat:
            shapes.append(tuple(flat[1:1 + flat[0]]))
            flat = flat[1 + flat[0]:]
        return shapes

    def _gathered(self, result, shapes: Sequence[tuple[int, ...]],
                  wanted: Sequence[tuple[int, str, str]]) -> dict[str, np.ndarray]:
        """The tensors of ``result`` that ``wanted`` names (index, name, dtype), whole on
        the host: rank 0's, or every rank's slice gathered to rank 0 and joined where the
        ranks hold parts of it (``output_shard_plan``)."""
        hosts = {}
        for index, name, dtype in wanted:
            shape, output = shapes[index], self._call("output", result, index)
            if name in self.output_shard_plan:  # every rank's slice, stacked on rank 0
                output = self._transport.gather(output, shape, dtype)
                shape = (self.world_size, *shape)
            hosts[name] = tvm.runtime.empty(shape, dtype)
            self.session.copy_from_worker_0(hosts[name], output)
        self.session.sync_worker_0()
        return {name: joined(host.numpy(), self.output_shard_plan[name])
                if name in self.output_shard_plan else host.numpy()
                for name, host in hosts.items()}

    def _steps_run(self, result) -> int:
        """The steps the ranks' loops ran, the same on every rank (else ``RankError``)."""
        steps = self._call("steps", result)
        counts = [int(steps.debug_get_from_remote(w)) for w in range(self.world_size)]
        if len(set(counts)) != 1:
            raise RankError(f"the ranks' loops ran {counts} steps: their stop flags differ")
        return counts[0]

    def _check_feed_back(self, feed_back: Mapping[str, str], gather: Collection[str]) -> None:
        """Refuse, before anything runs, a ``feed_back`` whose output could not be its
        input on a rank: names the model does not have, a bound input, an input named
        twice, another dtype or rank, a static size that differs, or a split that differs
        (a rank's part must be the part that rank takes). A decode loop passes the same one
        on every call: checked once (again after ``bind_inputs``)."""
        if isinstance(gather, str):
            raise TypeError(f"gather must be a collection of output names, got {gather!r}")
        key = (tuple(feed_back.items()), tuple(gather))
        if key == self._feed_back_checked:
            return
        outputs = {spec.name: spec for spec in self.signature.outputs}
        inputs = {spec.name: spec for spec in self.signature.inputs}
        unknown = sorted((set(feed_back) | set(gather)) - set(outputs))
        if unknown:
            raise InputError(f"output(s) {unknown} are not the model's: it returns "
                             f"{list(outputs)}")
        targets = list(feed_back.values())
        unknown = sorted(set(targets) - set(inputs))
        if unknown:
            raise InputError(f"feed_back names input(s) {unknown}, which the model does not "
                             f"take: its inputs are {list(inputs)}")
        if len(set(targets)) != len(targets) or set(targets) & self._bound:
            raise InputError(f"feed_back's inputs {targets} must be distinct and not bound "
                             f"(bind_inputs bound {sorted(self._bound)})")
        for out, name in feed_back.items():
            given, taken = outputs[out], inputs[name]
            if given.dtype != taken.dtype or len(given.shape) != len(taken.shape) or any(
                    isinstance(a, int) and isinstance(b, int) and a != b
                    for a, b in zip(given.shape, taken.shape)):
                raise InputError(f"output {out!r} ({given.dtype} {given.shape} on a rank) "
                                 f"cannot be input {name!r} ({taken.dtype} {taken.shape})")
            split, part = self.output_shard_plan.get(out), self.shard_plan.get(name)
            if split != part:
                raise InputError(f"output {out!r} comes out of a rank {placement_text(split)} and "
                                 f"input {name!r} is taken {placement_text(part)}: a rank can "
                                 "only keep what it takes")
        self._feed_back_checked = key

    def _whole_shape(self, name: str, part_shape: tuple[int, ...]) -> tuple[int, ...]:
        axis = self.shard_plan.get(name)
        if axis is None:
            return part_shape
        return (*part_shape[:axis], part_shape[axis] * self.world_size, *part_shape[axis + 1:])

    def _checked(self, inputs: Mapping[str, Any],
                 kept: Mapping[str, KeptOutput] | None = None) -> dict[str, int]:
        """The dims the inputs set, their rank 0 parts checked as the rank's executor will
        check them (names, dtypes, shapes, dims), with the parts ``kept`` on the ranks as
        they are, before anything is sent: a worker's failure on bad input would leave the
        others waiting in a collective."""
        self._check_open()
        shapes, dtypes = self._part_specs(inputs)
        for name, k in (kept or {}).items():
            shapes[name], dtypes[name] = k.part_shape, k.dtype
        return self.signature.bind(shapes, dtypes, bound=self._bound_dims.values,
                                   skip=self._bound)

    def _part_specs(self, inputs: Mapping[str, Any]) -> tuple[dict, dict]:
        """The shapes and dtypes of the inputs' rank 0 parts."""
        parts = {name: self._part(name, np.asarray(value)) for name, value in inputs.items()}
        return {k: v.shape for k, v in parts.items()}, {k: str(v.dtype) for k, v in parts.items()}

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

    def _send(self, inputs: Mapping[str, Any], kept: Mapping[str, KeptOutput] | None = None
              ) -> list:
        """The names, then each input on the ranks (its part where the plan splits it),
        then the parts ``kept`` on them, as they are."""
        kept = kept or {}
        names = [*inputs, *kept]
        if any("," in name for name in names):
            raise ValueError(f"input names with a comma cannot be sent to the ranks: {names}")
        sent = []
        for name in inputs:
            value = np.ascontiguousarray(inputs[name])
            axis = self.shard_plan.get(name)
            sent.append(self._transport.send(value, axis))
        return [",".join(names), *sent, *(k.parts for k in kept.values())]

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
        self._kept = {}  # their references free the parts while the session runs
        try:
            if self._loop is not None:
                session.call_packed(self._functions["close_loop"], self._loop)
            if self._executor is not None:
                session.call_packed(self._functions["run"], self._executor, "close", "")
                session._sync_all()  # pylint: disable=protected-access
        finally:
            self._executor = self._loop = None
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


class _DiscoTransport:
    """Inputs to the ranks and outputs back through disco's own collectives: a CPU
    artifact's (those of the session's ``ccl``, or whatever is registered as disco's)."""

    def __init__(self, ranks: TensorParallelSession, path: str | Path, ccl: str | None):
        self.ranks, self.path, self.ccl = ranks, path, ccl
        self._collectives_found = False

    def _check_collectives(self) -> None:
        """Refuse, before the first transfer, a session whose workers would not find the
        collectives: a worker failing to find them aborts the whole process."""
        if self._collectives_found:
            return
        if not _disco_collectives_registered(self.ccl):
            raise RuntimeError(f"{self.path}'s ranks run on the CPU, through disco's "
                               "collectives, and this TVM has none for the CPU (init_ccl takes "
                               "NCCL or RCCL): build the model for CUDA to run it on several "
                               "devices")
        self._collectives_found = True

    def send(self, value: np.ndarray, axis: int | None):
        """``value`` on every rank: whole, or rank r's part along ``axis``."""
        self._check_collectives()
        session, world = self.ranks.session, self.ranks.world_size
        if axis is None:
            return session.broadcast(value)
        return session.scatter(np.stack([rank_part("", value, axis, r, world)
                                         for r in range(world)]))

    def gather(self, output, part_shape: tuple[int, ...], dtype: str):
        """Every rank's ``output`` stacked on rank 0: (world, *part_shape)."""
        self._check_collectives()
        session = self.ranks.session
        stacked = session.empty((self.ranks.world_size, *part_shape), dtype, worker0_only=True)
        session.gather_to_worker0(output, stacked)
        return stacked


class _NcclTransport:
    """Inputs to the ranks and outputs back through each rank's NCCL communicator (its
    executor's, ``runtime/nccl.py``): a CUDA artifact's. This TVM's disco has no NCCL; its
    messages carry only worker 0's host copy (``copy_to_worker_0``), which rank 0 then
    broadcasts on the device."""

    def __init__(self, ranks: TensorParallelSession):
        self.ranks = ranks

    def send(self, value: np.ndarray, axis: int | None):
        session = self.ranks.session
        staged = session.empty(value.shape, str(value.dtype), worker0_only=True)  # its host
        # DLPack refuses a read-only array (np.broadcast_to, a memmap): a copy of that one
        host = value if value.flags.writeable else value.copy()
        session.copy_to_worker_0(tvm.runtime.tensor(host), staged)
        return self.ranks._call("receive", self.ranks._executor, staged,  # pylint: disable=protected-access
                                tvm.runtime.ShapeTuple(value.shape), str(value.dtype),
                                -1 if axis is None else axis)

    def gather(self, output, part_shape: tuple[int, ...], dtype: str):
        return self.ranks._call("gather", self.ranks._executor, output)  # pylint: disable=protected-access


# Sessions not closed yet, closed at exit while Python can still run the workers' functions
# (at finalization a worker waits for Python's lock forever and the process aborts).
_OPEN: "weakref.WeakSet[TensorParallelSession]" = weakref.WeakSet()


@atexit.register
def _close_open() -> None:
    for session in list(_OPEN):
        session.close()


# disco's scatter as TVM registers it, which calls the session's CCL's
# (runtime.disco.<ccl>.scatter_from_worker0); one registered over it stands on its own.
_DISCO_SCATTER = tvm.get_global_func("runtime.disco.scatter_from_worker0", allow_missing=True)


def _disco_collectives_registered(ccl: str | None) -> bool:
    """Whether the workers of a session on ``ccl`` find disco's collectives: TVM's own call
    the CCL's (none registers under the empty name of no CCL), others registered over them
    (as tests do) stand on their own."""
    scatter = tvm.get_global_func("runtime.disco.scatter_from_worker0", allow_missing=True)
    if scatter is None:
        return False
    if _DISCO_SCATTER is None or not scatter.same_as(_DISCO_SCATTER):
        return True
    return tvm.get_global_func(f"runtime.disco.{ccl or ''}.scatter_from_worker0",
                               allow_missing=True) is not None


def load_tensor_parallel(path: str | Path, devices: Sequence[int] | None = None,
                         **options: Any) -> TensorParallelSession:
    """A tensor-parallel artifact on ``devices`` (default ``0..N-1``): see
    ``TensorParallelSession``."""
    return TensorParallelSession(path, devices, **options)


# -- what each worker runs -------------------------------------------------------------------
def _error(err: BaseException) -> str:
    return f"{ERROR_PREFIX}{type(err).__name__}: {err}"


def _worker_device(devices: str) -> str:
    """This worker's device: the session's ``devices[worker]`` on CUDA (``devices``
    given), the CPU otherwise."""
    if not devices:
        return "cpu"
    return f"cuda:{[int(d) for d in devices.split(',')][_worker_rank()]}"


def _worker_rank() -> int:
    return int(tvm.get_global_func("runtime.disco.worker_id")()[0])


# The executors of this process's workers, by handle: a threaded session's workers are
# threads of one process (each handle is one worker's). Handles, not the executors
# themselves, travel in disco's references: a reference freed while a worker holds Python's
# lock would wait for it (a process session's worker 0 is a thread of the controller).
_EXECUTORS: dict[int, Any] = {}
_LOOPS: dict[int, Any] = {}  # the loop runner around an executor, by the executor's handle
_HANDLES = itertools.count(1)
_LOCK = threading.Lock()


# A rank's transfers (``_receive``, ``_gather``) run on its executor's stream, in order with
# its calls; worker 0's copies to and from the host run on the legacy stream, which that
# stream (a blocking one) follows and which waits for it: no rank function waits itself.


@tvm.register_global_func("grape.rank.load", override=True)
def _load(path: str, graph_mode: str, devices: str):
    """A handle of this worker's executor of ``path``, or the error as a string."""
    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    try:
        executor = load(path, _worker_device(devices), graph_mode=graph_mode)
    except Exception as err:  # pylint: disable=broad-except
        return _error(err)
    with _LOCK:
        handle = next(_HANDLES)
        _EXECUTORS[handle] = executor
    return handle


@tvm.register_global_func("grape.rank.join", override=True)
def _join(handle, world_size: int, group_id: str) -> str:
    """This rank's executor joins the NCCL group ``group_id`` (``ncclCommInitRank``, which
    waits for every rank: disco runs this on all of them together); "" or the error."""
    if isinstance(handle, str):
        return handle
    try:
        group = CollectiveGroup(_worker_rank(), int(world_size), bytes.fromhex(group_id))
        _EXECUTORS[handle].backend.join_collectives(group)
        return ""
    except Exception as err:  # pylint: disable=broad-except
        return _error(err)


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
        failed = _failed_transfer(tensors)
        if failed:
            return failed
        named = dict(zip(names.split(","), tensors)) if names else {}
        if action == "bind":
            executor.bind_inputs(named)
            return ""
        return list(executor.run(named, return_numpy=False).values())
    except Exception as err:  # pylint: disable=broad-except
        return _error(err)


def _failed_transfer(tensors) -> str | None:
    """The error of an input whose transfer to this rank failed (``_receive`` returns it in
    the tensor's place), or None."""
    return next((t for t in tensors if isinstance(t, str)), None)


@tvm.register_global_func("grape.rank.receive", override=True)
def _receive(handle, staged, shape, dtype: str, axis: int):
    """An input on this rank's device, from worker 0's host copy ``staged`` (None on the
    other workers), broadcast by NCCL from rank 0: whole, or this rank's part along
    ``axis`` (>= 0, copied out of the whole on the device); or the error as a string."""
    if isinstance(handle, str):
        return handle
    try:
        executor = _EXECUTORS[handle]
        backend = executor.backend
        whole = tvm.runtime.empty(tuple(shape), dtype, executor.device)
        if staged is not None:
            whole.copyfrom(staged)  # the legacy stream: the backend's blocking one follows it
        backend.nccl.broadcast(whole, whole, int(backend.stream))
        if axis < 0:
            return whole
        group = backend.nccl.group
        shape = list(whole.shape)
        shape[axis] //= group.world_size
        part = tvm.runtime.empty(tuple(shape), dtype, executor.device)
        copy_part(whole, part, axis, group.rank, group.world_size, backend.stream)
        backend.synchronize()  # ``whole`` is freed on return
        return part
    except Exception as err:  # pylint: disable=broad-except
        return _error(err)


@tvm.register_global_func("grape.rank.describe", override=True)
def _describe(handle) -> str:
    """This rank's ``backend.describe()`` as JSON, or the error as a string."""
    if isinstance(handle, str):
        return handle
    try:
        return json.dumps(_EXECUTORS[handle].backend.describe(), default=str)
    except Exception as err:  # pylint: disable=broad-except
        return _error(err)


@tvm.register_global_func("grape.rank.gather", override=True)
def _gather(handle, output):
    """Every rank's ``output`` stacked in rank order, (world, *shape), by NCCL's
    all-gather (rank 0's is read), or the error as a string."""
    if isinstance(handle, str) or isinstance(output, str):
        return handle if isinstance(handle, str) else output
    try:
        executor = _EXECUTORS[handle]
        backend = executor.backend
        stacked = tvm.runtime.empty((backend.nccl.group.world_size, *output.shape),
                                    str(output.dtype), executor.device)
        backend.nccl.run(CollectiveFunction("allgather"), output, stacked, int(backend.stream))
        return stacked
    except Exception as err:  # pylint: disable=broad-except
        return _error(err)


@tvm.register_global_func("grape.rank.load_loop", override=True)
def _load_loop(handle, path: str, mode: str):
    """The executor's ``handle`` again, its loop runner made (``loop_runner``), or the
    error as a string."""
    from grape_tvm.loop import loop_runner  # pylint: disable=import-outside-toplevel

    if isinstance(handle, str):  # its load failed: that error again
        return handle
    try:
        runner = loop_runner(_EXECUTORS[handle], path, mode)
    except Exception as err:  # pylint: disable=broad-except
        return _error(err)
    with _LOCK:
        _LOOPS[handle] = runner
    return handle


@tvm.register_global_func("grape.rank.run_loop", override=True)
def _run_loop(handle, max_steps: int, names: str, *tensors):
    """The loop of ``handle`` run from the named state tensors, this rank's part: the final
    state in the order of ``carried``, then the steps run; or the error as a string. Every
    rank stops at the same step when its stop flag is replicated (``compile_loop`` checks)."""
    if isinstance(handle, str):
        return handle
    try:
        runner = _LOOPS[handle]
        failed = _failed_transfer(tensors)
        if failed:
            return failed
        result = runner.run(dict(zip(names.split(","), tensors)), max_steps)
        return [*(result.state[name] for name in runner.spec.carried), result.steps]
    except Exception as err:  # pylint: disable=broad-except
        return _error(err)


@tvm.register_global_func("grape.rank.steps", override=True)
def _steps(result) -> int:
    """The steps a ``run_loop`` ran (-1 if it failed: the controller raises first)."""
    return -1 if isinstance(result, str) else int(result[-1])


@tvm.register_global_func("grape.rank.close_loop", override=True)
def _close_loop(handle) -> str:
    """Free the loop runner of ``handle`` (a device loop's graphs); its executor stays."""
    with _LOCK:
        runner = _LOOPS.pop(handle, None)
    if runner is not None:
        runner.close()
    return ""


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
    """Every output tensor's rank, then its dims, in one tuple (one read for all of them;
    a loop's step count, after its state, is not one)."""
    flat = []
    for output in [] if isinstance(outputs, str) else outputs:
        if isinstance(output, tvm.runtime.Tensor):
            flat += [len(output.shape), *output.shape]
    return tvm.runtime.ShapeTuple(flat)
