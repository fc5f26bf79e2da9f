"""Stream capture of one region call, and what is read back from the captured graph.

Also ``CapturedGraph``: one region at one shape instantiated as it was captured, the
per-shape fallback where device-updatable graph nodes are not available. It owns its
``CUgraph`` and ``CUgraphExec`` and frees them in ``close()``.

A region's kernels read and write the region's arguments, which TVM's VM allocates on every
call: a captured graph keeps the addresses of capture time. Kernel parameters that point
into a region argument are found once, after capture (``cuFuncGetParamInfo`` gives each
parameter's size); ``CapturedGraph`` re-points them from the host when a later call's
arguments live elsewhere (``cuGraphExecKernelNodeSetParams``).

A captured graph holds kernel nodes, and memset nodes where a library zeroes something
before its kernels (cuBLASLt's split-K counters in its workspace: where they lie and how
many there are follow M). In a per-shape graph a memset stays as captured; a topology graph
runs it as a kernel (``topology_graph.memsets_as_kernels``) whose address and size are
patched per shape. A graph with any other node, or with a memset into a region argument
(an address a later call moves), is not kept (``UnkeptGraph``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Sequence

import tvm

from .argument_table import NodeRecord
from .cuda_driver import check, driver
from .signature import nbytes


def address_of(arg: Any) -> int:
    """A region argument's device address: an executor buffer's ``Address`` is its own
    value, a tensor's is its ``data_ptr()``, a dim passed by value has none (0)."""
    return arg.data_ptr() if hasattr(arg, "data_ptr") else 0


# A parameter wider than this is taken apart into 8-byte words: library kernels (cuBLAS)
# take one struct of hundreds of bytes with the operands' addresses and sizes inside it,
# and the patch kernel writes at most 16 bytes at a time (bench/results/probe_cublaslt.json).
MAX_FIELD_BYTES = 16
WORD = 8
_BUFFER_POINTER, _BUFFER_SIZE = 1, 2  # CU_LAUNCH_PARAM_BUFFER_POINTER / _SIZE


@dataclass
class KernelNode:
    """One kernel node read back from a captured graph."""

    node: Any
    params: Any  # CUDA_KERNEL_NODE_PARAMS as captured
    layout: list[tuple[int, int]]  # (offset, size) of each field (``fields_of``)
    values: list[bytes]  # raw bytes of each field
    cluster_blocks: int = 1  # blocks per thread-block cluster (``cluster_blocks``)


@dataclass(frozen=True)
class MemsetNode:
    """One memset node read back from a captured graph."""

    dst: int
    value: int
    element_size: int
    width: int
    height: int
    pitch: int

    @property
    def span(self) -> tuple[int, int]:
        """First byte written and one past the last."""
        rows = max(self.height - 1, 0) * self.pitch
        return self.dst, self.dst + rows + self.width * self.element_size


@dataclass
class CapturedNodes:
    """The nodes of a captured graph that grape keeps: kernels, and memsets (with the
    graph's node of each in ``memset_nodes``)."""

    kernels: list[KernelNode]
    memsets: list[MemsetNode]
    memset_nodes: list[Any]


class UnkeptGraph(Exception):
    """A captured graph that cannot be replayed for later calls (the reason says why)."""


@dataclass(frozen=True)
class PointerSlot:
    """Kernel parameter ``param`` of node ``node`` points ``delta`` bytes into region arg ``arg``."""

    node: int
    param: int
    arg: int
    delta: int


def _parameters(func) -> list[tuple[int, int]]:
    """(offset, size) of each parameter of a kernel (``cuFuncGetParamInfo``)."""
    parameters = []
    while True:
        err, offset, size = driver.cuFuncGetParamInfo(func, len(parameters))
        if err != driver.CUresult.CUDA_SUCCESS:
            return parameters
        parameters.append((int(offset), int(size)))


def fields_of(parameters: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The fields a patch may write, (offset, size) in the parameter buffer: each parameter,
    one wider than ``MAX_FIELD_BYTES`` as 8-byte words."""
    fields = []
    for offset, size in parameters:
        if size <= MAX_FIELD_BYTES:
            fields.append((offset, size))
        else:
            fields += [(at, min(WORD, offset + size - at)) for at in range(offset, offset + size, WORD)]
    return fields


def parameter_buffer(params, parameters: Sequence[tuple[int, int]]) -> bytes:
    """A kernel node's parameter buffer as the kernel receives it: the one buffer of
    ``extra`` (``CU_LAUNCH_PARAM_BUFFER_POINTER``: how cuBLAS launches its sm90 kernels,
    ``kernelParams`` NULL), or the values ``kernelParams`` points at, one per parameter."""
    extra = int(params.extra or 0)
    if extra:
        pointer = size = None
        entries = (ctypes.c_void_p * 5).from_address(extra)
        for key, value in zip(entries[::2], entries[1::2]):
            if not key:  # CU_LAUNCH_PARAM_END
                break
            if key == _BUFFER_POINTER:
                pointer = value
            elif key == _BUFFER_SIZE:
                size = ctypes.c_size_t.from_address(value).value
        if not pointer or size is None:
            raise ValueError("a kernel node's extra holds no parameter buffer")
        return ctypes.string_at(pointer, size)
    base = int(params.kernelParams or 0)
    buffer = bytearray(max((offset + size for offset, size in parameters), default=0))
    for i, (offset, size) in enumerate(parameters):
        address = ctypes.c_void_p.from_address(base + 8 * i).value
        buffer[offset:offset + size] = ctypes.string_at(address, size)
    return bytes(buffer)


def graph_nodes(graph, kind=None) -> list:
    """A graph's nodes (of ``kind``, a ``CUgraphNodeType``, if given), in creation order."""
    _, count = check(driver.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
    nodes, _ = check(driver.cuGraphGetNodes(graph, count), "cuGraphGetNodes")
    nodes = list(nodes[:count])
    if kind is None:
        return nodes
    return [n for n in nodes if check(driver.cuGraphNodeGetType(n), "cuGraphNodeGetType") == kind]


def kernel_nodes(graph) -> list:
    return graph_nodes(graph, driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL)


def add_head_node(graph, params, what: str):
    """Add a kernel node (``params``) that every root of ``graph`` waits for; return it."""
    _, count = check(driver.cuGraphGetRootNodes(graph, 0), "cuGraphGetRootNodes")
    roots, _ = check(driver.cuGraphGetRootNodes(graph, count), "cuGraphGetRootNodes")
    roots = list(roots[:count])
    head = check(driver.cuGraphAddKernelNode(graph, None, 0, params), f"cuGraphAddKernelNode({what})")
    check(driver.cuGraphAddDependencies(graph, [head] * len(roots), roots, None, len(roots)),
          "cuGraphAddDependencies")
    return head


def read_nodes(graph, layouts: dict | None = None) -> CapturedNodes:
    """Kernel and memset nodes of a captured graph, kernels with their parameters;
    ``layouts`` caches each function's parameters across captures. Raises ``UnkeptGraph``
    for a graph with nodes of another type."""
    layouts = {} if layouts is None else layouts
    kernels, memsets, memset_nodes = [], [], []
    for node in graph_nodes(graph):
        kind = check(driver.cuGraphNodeGetType(node), "cuGraphNodeGetType")
        if kind == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEMSET:
            p = check(driver.cuGraphMemsetNodeGetParams(node), "cuGraphMemsetNodeGetParams")
            # Nodes come back in the order the capture created them: a stream's order.
            memsets.append(MemsetNode(int(p.dst), int(p.value), int(p.elementSize),
                                      int(p.width), int(p.height), int(p.pitch)))
            memset_nodes.append(node)
            continue
        if kind != driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            raise UnkeptGraph(f"it holds a {kind.name} node (grape replays kernel and memset "
                              "nodes)")
        params = check(driver.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
        key = int(params.func)
        parameters = layouts.get(key)
        if parameters is None:
            parameters = layouts[key] = _parameters(params.func)
        buffer = parameter_buffer(params, parameters)
        fields = fields_of(parameters)
        kernels.append(KernelNode(node, params, fields,
                                  [buffer[offset:offset + size] for offset, size in fields],
                                  cluster_blocks(node, params)))
    return CapturedNodes(kernels, memsets, memset_nodes)


# The most blocks a thread-block cluster may have (sm_90, non-portable sizes included).
MAX_CLUSTER_BLOCKS = 16


def cluster_blocks(node, params=None) -> int:
    """The blocks per thread-block cluster a kernel node is launched with (1: no clusters).
    ``params``: its CUDA_KERNEL_NODE_PARAMS, read where not given."""
    dim = check(driver.cuGraphKernelNodeGetAttribute(
        node, driver.CUkernelNodeAttrID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION),
        "cuGraphKernelNodeGetAttribute(cluster)").clusterDim
    if params is None:
        params = check(driver.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
    return cluster_size((dim.x, dim.y, dim.z), (params.gridDimX, params.gridDimY,
                                                params.gridDimZ))


def cluster_size(dims: Sequence[int], grid: Sequence[int]) -> int:
    """Blocks per cluster of cluster dims ``dims`` read from a node of grid ``grid``; 1 where
    they are no cluster. The driver leaves the attribute of a node launched without one
    unset, and reads back whatever it holds (on the H200, for one of PyTorch's kernels,
    (100, 0, 843995743)): a cluster has every dim at least 1, dividing the grid's, and at
    most ``MAX_CLUSTER_BLOCKS`` blocks."""
    blocks = 1
    for d, g in zip(dims, grid):
        if d < 1 or g % d:
            return 1
        blocks *= d
    return blocks if blocks <= MAX_CLUSTER_BLOCKS else 1


def check_memsets(memsets: Sequence[MemsetNode], region_args: Sequence[Any]) -> None:
    """Raise ``UnkeptGraph`` if a memset writes into a region argument: a graph keeps its
    address, and a later call's argument may live elsewhere."""
    spans = _argument_spans(region_args)
    for m in memsets:
        first, end = m.span
        for arg, start, size in spans:
            if size and first < start + size and start < end:
                raise UnkeptGraph(f"a memset writes into region argument {arg}, whose "
                                  "address a later call may move")


def _argument_spans(region_args: Sequence[Any]) -> list[tuple[int, int, int]]:
    """(index, first byte, size) of each tensor argument of a region."""
    return [(i, a.data_ptr(), nbytes(a)) for i, a in enumerate(region_args)
            if isinstance(a, tvm.runtime.Tensor)]


def find_pointer_slots(nodes: Sequence[KernelNode], region_args: Sequence[Any]) -> list[PointerSlot]:
    """Parameters whose 8 bytes point into one of the region's tensor arguments."""
    spans = _argument_spans(region_args)
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
        # The first launch after instantiation, or after the table was encoded again, showed
        # stale parameters on some nodes on our H200 unless the graph was uploaded
        # (docs/design.md); the patch node's switch between launch records is not followed
        # by one (``TopologyGraph._point_patch_node``).
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
    def _addresses(region_args: Sequence[Any]) -> list[int]:
        return [address_of(a) for a in region_args]

    def replay(self, region_args: Sequence[Any], stream) -> None:
        addresses = self._addresses(region_args)
        if addresses != self._bound:
            self._repoint(addresses)
        check(driver.cuGraphLaunch(self.exec, stream), "cuGraphLaunch")

    def _repoint(self, addresses: list[int]) -> None:
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
        # The whole parameter buffer through ``extra``: right for kernels launched either way.
        end = max(offset + size for offset, size in node.layout)
        buffer = ctypes.create_string_buffer(end)
        for (offset, size), value in zip(node.layout, values):
            ctypes.memmove(ctypes.addressof(buffer) + offset, value, size)
        size = ctypes.c_size_t(end)
        extra = (ctypes.c_void_p * 5)(_BUFFER_POINTER, ctypes.addressof(buffer), _BUFFER_SIZE,
                                      ctypes.addressof(size), 0)
        old = node.params
        params = driver.CUDA_KERNEL_NODE_PARAMS()
        params.func = old.func
        params.gridDimX, params.gridDimY, params.gridDimZ = old.gridDimX, old.gridDimY, old.gridDimZ
        params.blockDimX, params.blockDimY, params.blockDimZ = (
            old.blockDimX, old.blockDimY, old.blockDimZ)
        params.sharedMemBytes = old.sharedMemBytes
        params.kernelParams = 0
        params.extra = ctypes.addressof(extra)
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
    """Argument-table records of a captured region's kernels (a topology graph's memsets
    are kernels by then: ``topology_graph.memsets_as_kernels``).

    Parameters that point into a region argument are part of the topology (which argument,
    at which offset); their field is zeros of their size (counted in a full table, never a
    column): their value is the call's, not the shape's. So is the grid of a node launched in
    clusters: on the H200 a device-side grid update of such a node (even to the grid it has)
    leaves it launching slower and computing wrong results, while parameter updates leave it
    right (``bench/results/device_updatable.clusters.json``: a clustered decode attention
    kernel, tried in bench/experiments/decode_attention_clusters.patch).
    """
    by_node: dict[int, dict[int, PointerSlot]] = {}
    for s in slots:
        by_node.setdefault(s.node, {})[s.param] = s
    records = []
    for n, node in enumerate(nodes):
        p = node.params
        pointers = by_node.get(n, {})
        grid = (p.gridDimX, p.gridDimY, p.gridDimZ)
        fixed = ((p.blockDimX, p.blockDimY, p.blockDimZ), p.sharedMemBytes,
                 tuple(size for _, size in node.layout),
                 tuple(sorted((i, s.arg, s.delta) for i, s in pointers.items())))
        if node.cluster_blocks > 1:
            fixed += (grid,)
        fields = (grid,) + tuple(
            bytes(len(v)) if i in pointers else v for i, v in enumerate(node.values))
        records.append(NodeRecord(int(p.func), fixed, fields))
    return records
