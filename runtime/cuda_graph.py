"""CUDA backend: each region captured per shape into a CUDA graph, replayed with one launch.

Ownership: ``CudaGraphBackend`` owns its two streams and its context reference;
``CapturedGraph`` owns its ``CUgraph`` and ``CUgraphExec``. Each frees what it owns in
``close()`` (and, as a last resort, when collected).

A region's kernels read and write the region's arguments, which TVM's VM allocates on every
call: the captured graph keeps the addresses of capture time. Kernel parameters that point
into a region argument are found once, after capture (``cuFuncGetParamInfo`` gives each
parameter's size), and re-pointed from the host when a later call's arguments live
elsewhere (``cuGraphExecKernelNodeSetParams``). With memory planned at the upper bound and
the VM's pooled allocator this is rare: the same storage comes back call after call.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import tvm

from .cuda_driver import check, driver


@dataclass
class KernelNode:
    """One kernel node read back from a captured graph."""

    node: Any
    params: Any  # CUDA_KERNEL_NODE_PARAMS as captured
    layout: list[tuple[int, int]]  # (offset, size) of each parameter
    values: list[bytes]  # raw bytes of each parameter


@dataclass(frozen=True)
class PointerSlot:
    """Kernel parameter ``param`` of node ``node`` points ``delta`` bytes into region arg ``arg``."""

    node: int
    param: int
    arg: int
    delta: int


def _param_layout(func) -> list[tuple[int, int]]:
    layout = []
    while True:
        err, offset, size = driver.cuFuncGetParamInfo(func, len(layout))
        if err != driver.CUresult.CUDA_SUCCESS:
            return layout
        layout.append((int(offset), int(size)))


def _read_kernel_nodes(graph) -> list[KernelNode]:
    _, count = check(driver.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
    nodes, _ = check(driver.cuGraphGetNodes(graph, count), "cuGraphGetNodes")
    kernels = []
    for node in nodes[:count]:
        kind = check(driver.cuGraphNodeGetType(node), "cuGraphNodeGetType")
        if kind != driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            continue
        params = check(driver.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
        layout = _param_layout(params.func)
        base = int(params.kernelParams)
        values = []
        for i, (_, size) in enumerate(layout):
            addr = ctypes.c_void_p.from_address(base + 8 * i).value
            values.append(ctypes.string_at(addr, size))
        kernels.append(KernelNode(node, params, layout, values))
    return kernels


def _tensor_span(t) -> tuple[int, int]:
    nbytes = int(np.prod(t.shape, dtype=np.int64)) * np.dtype(str(t.dtype)).itemsize
    return t.data_ptr(), nbytes


def find_pointer_slots(nodes: Sequence[KernelNode], region_args: Sequence[Any]) -> list[PointerSlot]:
    """Parameters whose 8 bytes point into one of the region's tensor arguments."""
    spans = [(i, *_tensor_span(a)) for i, a in enumerate(region_args)
             if isinstance(a, tvm.runtime.Tensor)]
    slots = []
    for n, node in enumerate(nodes):
        for p, value in enumerate(node.values):
            if len(value) != 8:
                continue
            ptr = int.from_bytes(value, "little")
            for arg, start, nbytes in spans:
                if nbytes and start <= ptr < start + nbytes:
                    slots.append(PointerSlot(n, p, arg, ptr - start))
                    break
    return slots


class CapturedGraph:
    """One region at one shape: an instantiated CUDA graph and where its pointers come from."""

    def __init__(self, graph, nodes: list[KernelNode], slots: list[PointerSlot],
                 region_args: Sequence[Any], stream):
        self.graph = graph
        self.nodes = nodes
        self.slots = slots
        self._bound = self._addresses(region_args)
        self.exec = check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        # The first launch after instantiation showed stale parameters on some nodes on
        # our H200 unless the graph was uploaded first (DESIGN.md).
        check(driver.cuGraphUpload(self.exec, stream), "cuGraphUpload")
        self.patched_nodes = 0

    @staticmethod
    def _addresses(region_args: Sequence[Any]) -> list[int | None]:
        return [a.data_ptr() if isinstance(a, tvm.runtime.Tensor) else None for a in region_args]

    def replay(self, region_args: Sequence[Any], stream) -> None:
        addresses = self._addresses(region_args)
        if addresses != self._bound:
            self._repoint(addresses)
        check(driver.cuGraphLaunch(self.exec, stream), "cuGraphLaunch")

    def _repoint(self, addresses: list[int | None]) -> None:
        changed: dict[int, list[bytes]] = {}
        for s in self.slots:
            if addresses[s.arg] != self._bound[s.arg]:
                values = changed.setdefault(s.node, list(self.nodes[s.node].values))
                values[s.param] = (addresses[s.arg] + s.delta).to_bytes(8, "little")
        for n, values in changed.items():
            self._set_node_params(self.nodes[n], values)
        self.patched_nodes += len(changed)
        self._bound = addresses
        for n, values in changed.items():
            self.nodes[n].values = values

    def _set_node_params(self, node: KernelNode, values: list[bytes]) -> None:
        buffers = [ctypes.create_string_buffer(v, len(v)) for v in values]
        pointers = (ctypes.c_void_p * len(buffers))(*[ctypes.addressof(b) for b in buffers])
        old = node.params
        params = driver.CUDA_KERNEL_NODE_PARAMS()
        params.func = old.func
        params.gridDimX, params.gridDimY, params.gridDimZ = old.gridDimX, old.gridDimY, old.gridDimZ
        params.blockDimX, params.blockDimY, params.blockDimZ = (
            old.blockDimX, old.blockDimY, old.blockDimZ)
        params.sharedMemBytes = old.sharedMemBytes
        params.kernelParams = ctypes.addressof(pointers)
        check(driver.cuGraphExecKernelNodeSetParams(self.exec, node.node, params),
              "cuGraphExecKernelNodeSetParams")

    def close(self) -> None:
        if getattr(self, "exec", None) is not None:
            driver.cuGraphExecDestroy(self.exec)
            self.exec = None
        if getattr(self, "graph", None) is not None:
            driver.cuGraphDestroy(self.graph)
            self.graph = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # pylint: disable=broad-except
            pass  # interpreter shutdown: the driver may already be gone


class _Capture:
    """An open stream capture of one region call."""

    def __init__(self, region_args: Sequence[Any], stream_context):
        self.region_args = list(region_args)
        self.stream_context = stream_context

    def on_call(self, func, symbol: str, args: Sequence[Any]) -> None:
        pass  # stream capture sees the launches itself


class CudaGraphBackend:
    """Captures regions with CUDA stream capture and replays them as graphs."""

    name = "cuda-graph"

    def __init__(self, device: tvm.runtime.Device):
        import tvm_ffi  # pylint: disable=import-outside-toplevel

        self.device = device
        self._use_stream = tvm_ffi.use_raw_stream
        check(driver.cuInit(0), "cuInit")
        self._cu_device = check(driver.cuDeviceGet(device.index), "cuDeviceGet")
        self._context = check(driver.cuDevicePrimaryCtxRetain(self._cu_device),
                              "cuDevicePrimaryCtxRetain")
        check(driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
        # Calls run on a blocking stream, so they order with TVM's copies on the legacy
        # default stream; captures happen on a stream of their own that never runs work.
        self.stream = check(driver.cuStreamCreate(0), "cuStreamCreate")
        self.capture_stream = check(
            driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self.graphs_captured = 0

    def stream_context(self):
        """TVM launches everything of a call on the backend's stream."""
        return self._use_stream(self.device, int(self.stream))

    def begin(self, region_args: Sequence[Any]) -> _Capture:
        ctx = self._use_stream(self.device, int(self.capture_stream))
        check(driver.cuStreamBeginCapture(
            self.capture_stream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
            "cuStreamBeginCapture")
        ctx.__enter__()
        return _Capture(region_args, ctx)

    def end(self, capture: _Capture) -> CapturedGraph:
        capture.stream_context.__exit__(None, None, None)
        graph = check(driver.cuStreamEndCapture(self.capture_stream), "cuStreamEndCapture")
        nodes = _read_kernel_nodes(graph)
        slots = find_pointer_slots(nodes, capture.region_args)
        captured = CapturedGraph(graph, nodes, slots, capture.region_args, self.stream)
        self.graphs_captured += 1
        # Capture recorded the launches without running them: run them now.
        captured.replay(capture.region_args, self.stream)
        return captured

    def replay(self, graph: CapturedGraph, region_args: Sequence[Any]) -> None:
        graph.replay(region_args, self.stream)

    def abort(self, capture: _Capture) -> None:
        capture.stream_context.__exit__(None, None, None)
        err, graph = driver.cuStreamEndCapture(self.capture_stream)
        if err == driver.CUresult.CUDA_SUCCESS and graph is not None:
            driver.cuGraphDestroy(graph)

    def synchronize(self) -> None:
        check(driver.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def describe(self) -> dict:
        return {"backend": self.name, "graphs_captured": self.graphs_captured}

    def close(self) -> None:
        for attr in ("stream", "capture_stream"):
            stream = getattr(self, attr, None)
            if stream is not None:
                driver.cuStreamDestroy(stream)
                setattr(self, attr, None)
        if getattr(self, "_context", None) is not None:
            driver.cuDevicePrimaryCtxRelease(self._cu_device)
            self._context = None
