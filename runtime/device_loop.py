"""Loops over a step function: driven from the host, or as one CUDA graph that decides on
the device when to stop.

A step function maps a loop state to the next state and a stop flag (``LoopSpec``): the
step's inputs named in ``carried`` are the state, its outputs are their next values in the
same order and then ``stop``; every other input is a loop invariant (weights), bound once
with ``GraphExecutor.bind_inputs``. The loop runs until ``stop`` is set or ``max_steps``
steps ran.

``HostLoop`` calls the executor once per step and reads ``stop`` back after each: any
backend, the CPU's included, and what a Python decode loop does. ``DeviceLoop`` (CUDA)
builds one graph per state shape::

    WHILE (handle, 1 at every launch)
      body: the step's kernels, captured on the loop's own state buffers
            -> copies of the next state onto the state (parts not written in place)
            -> grape_loop_continue: counts the step, reads stop, sets the handle

so one launch runs the whole loop; the host writes the step limit before the launch and
reads the step count after it.
"""

from __future__ import annotations

import ctypes
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import tvm
import tvm_ffi
from tvm.runtime.vm import VirtualMachine

from .cuda_compile import RuntimeKernel
from .cuda_driver import check, driver
from .cuda_graph import OwnedGraph
from .signature import InputError, nbytes
from .cuda_compile import kernel_params
from .topology_graph import DeviceBuffer

LOOP_SOURCE = Path(__file__).with_name("kernels") / "loop.cu"
STOP_DTYPES = ("bool", "int8", "uint8", "int16", "int32", "int64", "uint32", "uint64")


@dataclass(frozen=True)
class LoopSpec:
    """Which step inputs are the loop state, which output stops it, and the step limit."""

    carried: tuple[str, ...]
    stop: str
    max_steps: int

    def to_json(self) -> dict:
        return {"carried": list(self.carried), "stop": self.stop, "max_steps": self.max_steps}

    @classmethod
    def from_json(cls, obj: dict) -> "LoopSpec":
        return cls(tuple(obj["carried"]), obj["stop"], int(obj["max_steps"]))

    def limit(self, max_steps: int | None) -> int:
        steps = self.max_steps if max_steps is None else int(max_steps)
        if steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        return steps


@dataclass
class LoopResult:
    """The state after the last step run, and how many steps ran."""

    state: dict[str, Any]
    steps: int


def _on_host(value: Any) -> bool:
    return isinstance(value, np.ndarray) or np.isscalar(value)


def _check_state(spec: LoopSpec, state: Mapping[str, Any]) -> None:
    missing = [n for n in spec.carried if n not in state]
    extra = [n for n in state if n not in spec.carried]
    if missing or extra:
        raise InputError(f"the loop state is {list(spec.carried)}: missing {missing}, "
                         f"unknown {extra} (loop invariants are bound with bind_inputs)")


def fill_state(state: Mapping[str, tvm.runtime.Tensor], values: Mapping[str, Any]
               ) -> tuple[int, int]:
    """Copy a loop's initial state into its own buffers ``state``; a buffer passed back (the
    last run's state) stays as it is. Returns the bytes copied from the host and from the
    device."""
    from_host = from_device = 0
    for name, value in values.items():
        own = state[name]
        if _on_host(value):
            value = np.asarray(value, order="C")  # keeps a 0-d value 0-d
            from_host += value.nbytes
        elif value.data_ptr() == own.data_ptr():
            continue
        else:
            from_device += nbytes(value)
        own.copyfrom(value)
    return from_host, from_device


class HostLoop:
    """One executor call per step; ``stop`` read back on the host after each. The state a
    run returns is copied into buffers of the loop's own, one set per state shape (as
    ``LoopGraph`` keeps its), so that it stays valid until the next run at that shape: the
    executor's outputs are written again by its next call at any dims."""

    def __init__(self, executor, spec: LoopSpec):
        self.executor = executor
        self.spec = spec
        self._states: dict[tuple, dict[str, tvm.runtime.Tensor]] = {}  # by state shape

    def run(self, state: Mapping[str, Any], max_steps: int | None = None) -> LoopResult:
        _check_state(self.spec, state)
        limit = self.spec.limit(max_steps)
        current, steps = dict(state), 0
        while steps < limit:
            out = self.executor.run(current, return_numpy=False)
            steps += 1
            current = {name: out[name] for name in self.spec.carried}
            if out[self.spec.stop].numpy().any():  # the host waits for the GPU here
                break
        return LoopResult(self._kept(current), steps)

    def _kept(self, state: dict[str, tvm.runtime.Tensor]) -> dict[str, tvm.runtime.Tensor]:
        """``state`` copied into the loop's own buffers of its shape (on the executor's
        stream, after the step that wrote it)."""
        key = tuple((name, tuple(value.shape), str(value.dtype)) for name, value in state.items())
        own = self._states.get(key)
        if own is None:
            own = self._states[key] = {name: tvm.runtime.empty(value.shape, value.dtype,
                                                               value.device)
                                       for name, value in state.items()}
        with self.executor.backend.stream_context():
            # A value passed through from the run's first step may be one of these very
            # buffers, under another name (a swap): copied aside before any is written.
            mine = {own[name].data_ptr(): name for name in own}
            sources = {name: _copy(value) if mine.get(value.data_ptr(), name) != name else value
                       for name, value in state.items()}
            for name, value in sources.items():
                if value.data_ptr() != own[name].data_ptr():
                    own[name].copyfrom(value)
        return dict(own)

    def close(self) -> None:
        """Give the state buffers up (the executor is its owner's to close)."""
        self._states.clear()


def _copy(tensor: tvm.runtime.Tensor) -> tvm.runtime.Tensor:
    copy = tvm.runtime.empty(tensor.shape, tensor.dtype, tensor.device)
    copy.copyfrom(tensor)
    return copy


class LoopGraph(OwnedGraph):
    """The loop at one state shape: its state buffers, step counter, graph and exec."""

    def __init__(self, state: dict[str, tvm.runtime.Tensor], stream, bound_version: int):
        self.state = state  # the loop's own buffers; the body reads and writes them
        self.counter = DeviceBuffer(8)  # {u32 steps, u32 max_steps}
        self.stream = stream
        self.graph = check(driver.cuGraphCreate(0), "cuGraphCreate")
        self.body_copy_bytes = 0  # per step, inside the graph
        self.bound_version = bound_version  # of the executor's bound inputs it reads

    def add_while(self, context):
        """The WHILE node, its handle set to 1 at each launch; returns (handle, body graph)."""
        handle = check(driver.cuGraphConditionalHandleCreate(
            self.graph, context, 1, driver.CU_GRAPH_COND_ASSIGN_DEFAULT),
            "cuGraphConditionalHandleCreate")
        params = driver.CUgraphNodeParams()
        params.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
        params.conditional.size = 1
        params.conditional.ctx = context
        check(driver.cuGraphAddNode(self.graph, None, None, 0, params), "cuGraphAddNode(WHILE)")
        return handle, params.conditional.phGraph_out[0]

    def launch(self, max_steps: int) -> None:
        limits = struct.pack("<II", 0, max_steps)  # pageable: staged before the call returns
        check(driver.cuMemcpyHtoDAsync(self.counter.address, limits, len(limits), self.stream),
              "cuMemcpyHtoDAsync(loop counter)")
        check(driver.cuGraphLaunch(self.exec, self.stream), "cuGraphLaunch(loop)")

    def wait(self) -> None:
        check(driver.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def steps(self) -> int:
        """Steps the last launch ran (after ``wait``)."""
        out = bytearray(4)
        check(driver.cuMemcpyDtoH(out, self.counter.address, 4), "cuMemcpyDtoH(loop counter)")
        return struct.unpack("<I", out)[0]

    def close(self) -> None:
        super().close()
        self.counter.close()


class DeviceLoop:
    """The whole loop as one CUDA graph launch (see the module docstring).

    Owns its continue kernel, a plain VM for issuing the step's region functions under
    capture, and one ``LoopGraph`` per state shape; ``close()`` frees them. The state it
    returns lives in the loop's own buffers: valid until the next ``run`` at that shape, and
    passed back as the next ``run``'s state, read where it is.
    """

    def __init__(self, executor, spec: LoopSpec, library: tvm.runtime.Module):
        backend = executor.backend
        if getattr(backend, "name", "") != "cuda-graph":
            raise ValueError("DeviceLoop needs the CUDA graph backend; use HostLoop elsewhere")
        self.executor = executor
        self.spec = spec
        self.backend = backend
        self._vm = VirtualMachine(library, executor.device)  # uninstrumented: for capture
        self._kernel = RuntimeKernel(backend.cubins, LOOP_SOURCE, "grape_loop_continue")
        self._graphs: dict[tuple, LoopGraph] = {}
        self.launches = 0
        self.h2d_bytes = 0  # initial states given as host arrays
        self.d2d_bytes = 0  # initial states given as device tensors of the caller's
        self.last_host_s = 0.0  # the last run's host time, without the wait for the GPU

    # -- calls ---------------------------------------------------------------------------
    def run(self, state: Mapping[str, Any], max_steps: int | None = None) -> LoopResult:
        start = time.perf_counter()
        _check_state(self.spec, state)
        limit = self.spec.limit(max_steps)
        # Host arrays are copied once, straight into the loop's buffers (``fill_state``).
        values = {n: np.asarray(state[n]) if _on_host(state[n])
                  else self.executor.device_tensor(n, state[n]) for n in self.spec.carried}
        key = tuple((n, tuple(v.shape), str(v.dtype)) for n, v in values.items())
        graph = self._graphs.get(key)
        if graph is not None and graph.bound_version != self.executor.bound_version:
            graph.close()  # its body reads the invariants bound before: build it again
            graph = None
        if graph is None:
            graph = self._graphs[key] = self._build(key)
        h2d, d2d = fill_state(graph.state, values)
        self.h2d_bytes += h2d
        self.d2d_bytes += d2d
        with self.backend.stream_context():
            graph.launch(limit)
        self.launches += 1
        launched = time.perf_counter()
        graph.wait()
        waited = time.perf_counter()
        result = LoopResult(dict(graph.state), graph.steps())
        self.last_host_s = (launched - start) + (time.perf_counter() - waited)
        return result

    # -- building ----------------------------------------------------------------------
    def _build(self, key: tuple) -> LoopGraph:
        unbound = [t.name for t in self.executor.signature.inputs
                   if t.name not in self.spec.carried and t.name not in self.executor.bound_names]
        if unbound:
            raise InputError(f"loop invariant(s) {unbound} are not bound: bind them with "
                             "bind_inputs before running the loop")
        device = self.executor.device
        state = {n: tvm.runtime.tensor(np.zeros(shape, dtype), device) for n, shape, dtype in key}
        # Two calls on zeros: the first records the step's regions, the second plans them.
        for _ in range(2):
            self.executor.run(state, return_numpy=False)
        self.backend.synchronize()
        regions, outputs = self.executor.trace(state)
        graph = LoopGraph(state, self.backend.stream, self.executor.bound_version)
        try:
            handle, body = graph.add_while(self.backend.context)
            self._capture_body(graph, body, handle, regions, outputs)
            graph.instantiate(self.backend.stream)
        except BaseException:
            graph.close()
            raise
        return graph

    def _capture_body(self, graph: LoopGraph, body, handle, regions, outputs) -> None:
        stream = self.backend.capture_stream
        check(driver.cuStreamBeginCaptureToGraph(
            stream, body, None, None, 0,
            driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
            "cuStreamBeginCaptureToGraph")
        try:
            with self.backend.capture_context():
                for region, shape, args in regions:
                    self._vm[region](*args, tvm_ffi.Shape(list(shape)))
            names = [t.name for t in self.executor.signature.outputs]
            for name in self.spec.carried:
                src, dst = outputs[names.index(name)], graph.state[name]
                if src.data_ptr() != dst.data_ptr():  # not written in place
                    check(driver.cuMemcpyDtoDAsync(dst.data_ptr(), src.data_ptr(), nbytes(dst),
                                                   stream), "cuMemcpyDtoDAsync(loop state)")
                    graph.body_copy_bytes += nbytes(dst)
            stop = outputs[names.index(self.spec.stop)]
            self._launch_continue(handle, stop, graph.counter.address, stream)
        finally:
            err, _ = driver.cuStreamEndCapture(stream)
        if err != driver.CUresult.CUDA_SUCCESS:
            check(err, "cuStreamEndCapture(loop body)")

    def _launch_continue(self, handle, stop, counter, stream) -> None:
        storage = kernel_params([("u64", int(handle)), ("u64", stop.data_ptr()),
                                 ("u32", nbytes(stop)), ("u64", counter)])  # alive until launched
        check(driver.cuLaunchKernel(self._kernel.function, 1, 1, 1, 1, 1, 1, 0, stream,
                                    ctypes.addressof(storage[1]), 0), "cuLaunchKernel(continue)")

    # -- what is held ------------------------------------------------------------------
    def describe(self) -> dict:
        return {"loop_graphs": [{"state": [list(k) for k in key], "body_copy_bytes_per_step":
                                 g.body_copy_bytes} for key, g in self._graphs.items()],
                "launches": self.launches, "h2d_bytes": self.h2d_bytes,
                "d2d_bytes": self.d2d_bytes}

    def close(self) -> None:
        for graph in self._graphs.values():
            graph.close()
        self._graphs.clear()
        if self._kernel is not None:
            self._kernel.close()
            self._kernel = None

    def __enter__(self) -> "DeviceLoop":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
