"""Stream capture of one region call, and what is read back from the captured graph.

Also ``CapturedGraph``: one region at one shape instantiated as it was captured, the
per-shape fallback where device-updatable graph nodes are not available. It owns its
``CUgraph`` and ``CUgraphExec`` and frees them in ``close()``.

A region's kernels read and write the region's arguments, which TVM's VM allocates on every
call: a captured graph keeps the addresses of capture time. Kernel parameters that point
into a region argument are found once, after capture (``cuFuncGetParamInfo`` gives each
parameter's size); ``CapturedGraph`` re-points them from the host when a later call's
arguments live elsewhere (``cuGraphExecKernelNodeSetParams``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Sequence

import tvm

from .argument_table import NodeRecord
from .cuda_driver import check, driver
from .signature import nbytes


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


def read_kernel_nodes(graph, layouts: dict | None = None) -> list[KernelNode]:
    """Kernel nodes of a captured graph with their parameters; ``layouts`` caches each
    function's parameter layout across captures."""
    layouts = {} if layouts is None else layouts
    _, count = check(driver.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
    nodes, _ = check(driver.cuGraphGetNodes(graph, count), "cuGraphGetNodes")
    kernels = []
    for node in nodes[:count]:
        kind = check(driver.cuGraphNodeGetType(node), "cuGraphNodeGetType")
        if kind != driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            continue
        params = check(driver.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
        key = int(params.func)
        layout = layouts.get(key)
        if layout is None:
            layout = layouts[key] = _param_layout(params.func)
        base = int(params.kernelParams)
        values = []
        for i, (_, size) in enumerate(layout):
            addr = ctypes.c_void_p.from_address(base + 8 * i).value
            values.append(ctypes.string_at(addr, size))
        kernels.append(KernelNode(node, params, layout, values))
    return kernels


def _tensor_span(t) -> tuple[int, int]:
    return t.data_ptr(), nbytes(t)


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
            for arg, start, size in spans:
                if size and start <= ptr < start + size:
                    slots.append(PointerSlot(n, p, arg, ptr - start))
                    break
    return slots


class OwnedGraph:
    """A ``CUgraph`` and its one instantiation, freed together by ``close()``."""

    graph = None
    exec = None

    def instantiate(self, stream) -> None:
        self.exec = check(driver.cuGraphInstantiate(self.graph, 0), "cuGraphInstantiate")
        self.upload(stream)

    def upload(self, stream) -> None:
        # The first launch after instantiation, or after a host-side change, showed stale
        # parameters on some nodes on our H200 unless the graph was uploaded (DESIGN.md).
        check(driver.cuGraphUpload(self.exec, stream), "cuGraphUpload")

    def close(self) -> None:
        if self.exec is not None:
            driver.cuGraphExecDestroy(self.exec)
            self.exec = None
        if self.graph is not None:
            driver.cuGraphDestroy(self.graph)
            self.graph = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # pylint: disable=broad-except
            pass  # interpreter shutdown: the driver may already be gone


class CapturedGraph(OwnedGraph):
    """One region at one shape: an instantiated CUDA graph and where its pointers come from."""

    def __init__(self, graph, nodes: list[KernelNode], slots: list[PointerSlot],
                 region_args: Sequence[Any], stream):
        self.graph = graph
        self.nodes = nodes
        self.slots = slots
        self._bound = self._addresses(region_args)
        self.instantiate(stream)

    @staticmethod
    def _addresses(region_args: Sequence[Any]) -> list[int | None]:
        return [a.data_ptr() if hasattr(a, "data_ptr") else None for a in region_args]

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


class Capture:
    """An open stream capture of one region call."""

    def __init__(self, region: str, shape: tuple, region_args: Sequence[Any], stream_context):
        self.region = region
        self.shape = shape
        self.region_args = list(region_args)
        self.stream_context = stream_context

    def on_call(self, func, symbol: str, args: Sequence[Any]) -> None:
        pass  # stream capture sees the launches itself


def node_records(nodes: Sequence[KernelNode], slots: Sequence[PointerSlot]) -> list[NodeRecord]:
    """Argument-table records of a captured region.

    Parameters that point into a region argument are part of the topology (which argument,
    at which offset); their field is zeros of their size (counted in a full table, never a
    column): their value is the call's, not the shape's.
    """
    by_node: dict[int, dict[int, PointerSlot]] = {}
    for s in slots:
        by_node.setdefault(s.node, {})[s.param] = s
    records = []
    for n, node in enumerate(nodes):
        p = node.params
        pointers = by_node.get(n, {})
        fixed = ((p.blockDimX, p.blockDimY, p.blockDimZ), p.sharedMemBytes,
                 tuple(size for _, size in node.layout),
                 tuple(sorted((i, s.arg, s.delta) for i, s in pointers.items())))
        fields = ((p.gridDimX, p.gridDimY, p.gridDimZ),) + tuple(
            bytes(len(v)) if i in pointers else v for i, v in enumerate(node.values))
        records.append(NodeRecord(int(p.func), fixed, fields))
    return records
