"""``CudaGraphBackend``: regions captured with CUDA stream capture, replayed as CUDA graphs.

Two modes:

- ``topology`` (default): one graph per region and topology; shapes of a topology share it
  through an argument table applied on the device by the patch kernel (``TopologyGraph``).
- ``per-shape``: one instantiated graph per region and shape (``CapturedGraph``), at most
  ``max_graphs`` of them (least recently used go first). The fallback where nodes cannot be
  made device-updatable (drivers before CUDA 12.4), and a baseline for the benchmarks.

In topology mode at most ``max_shapes`` shapes per region are held (their rows in the
argument tables); the least recently used is given up first and recorded again if it
comes back. Graphs of topologies stay.

A replay may carry guards, ``(condition tensor or address, expect)``: the region runs only if
each 1-byte condition is ``expect``. In topology mode the patch kernel reads them on the
device; per-shape graphs have no patch kernel, so the backend reads them on the host (a
synchronize: counted in ``synchronizing_guards``).

The backend owns its streams, its context reference, the patch kernel and every graph.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import tvm

from .argument_table import TopologyGroups
from . import attention, nccl
from .cublaslt import LIBRARY as CUBLASLT
from .cublaslt import CublasLt, register_functions
from .cuda_compile import CubinStore
from .cuda_driver import check, driver
from .cuda_graph import (Capture, CapturedGraph, CapturedNodes, OwnedGraph, UnkeptGraph,
                         check_memsets, find_pointer_slots, node_records,
                         read_nodes)
from .topology_graph import (PatchKernel, ReadyRecord, TopologyGraph, guard_address,
                             memsets_as_kernels)

MODES = ("topology", "per-shape")
DEVICE_UPDATE_DRIVER = 12040  # CUDA 12.4: device-updatable kernel nodes


def _free_bytes() -> int:
    free, _ = check(driver.cuMemGetInfo(), "cuMemGetInfo")
    return int(free)


@dataclass
class _RegionGraphs:
    """The topology groups of one region and the graph of each."""

    groups: TopologyGroups
    graphs: list[TopologyGraph]


class ReadyLaunch:
    """One replay of a topology graph, made again exactly (same row and arguments): its
    launch record kept as the replay left it (``ReadyRecord``). Valid until the backend
    records again, which may evict or move the row; the executor keeps it no longer."""

    __slots__ = ("backend", "graph", "record", "groups", "shape")

    def __init__(self, backend: "CudaGraphBackend", graph: TopologyGraph, record: ReadyRecord,
                 groups: TopologyGroups, shape: tuple):
        self.backend, self.graph, self.record = backend, graph, record
        self.groups, self.shape = groups, shape

    def __call__(self) -> None:
        self.groups.touch(self.shape)  # recently used, as a replay's lookup would mark it
        backend = self.backend
        start = time.perf_counter_ns()
        self.graph.launch_ready(self.record, backend.stream)
        backend.driver_ns += time.perf_counter_ns() - start
        backend.launches += 1


class CudaGraphBackend:
    """Captures regions with stream capture and replays them as CUDA graphs."""

    name = "cuda-graph"
    addresses_only = True  # replays read region arguments' addresses, nothing else
    records_by_running = False  # a capture runs nothing

    def __init__(self, device: tvm.runtime.Device, mode: str = "topology",
                 max_graphs: int = 4096, arch: str | None = None,
                 cubins: CubinStore | None = None, max_shapes: int | None = None,
                 libraries: Sequence[str] = (),
                 collectives: nccl.CollectiveGroup | None = None):
        import tvm_ffi  # pylint: disable=import-outside-toplevel

        if mode not in MODES:
            raise ValueError(f"graph mode must be one of {MODES}, got {mode!r}")
        self.device = device
        self.mode = mode
        self.max_graphs = max_graphs
        self.max_shapes = max_shapes
        self.fallback_reason: str | None = None
        self._use_stream = tvm_ffi.use_raw_stream
        # What close() frees, set before the first driver call so that a failed start
        # closes cleanly too.
        self._context = self.stream = self.capture_stream = None
        self.cublaslt: CublasLt | None = None
        self.attention: attention.FusedAttention | None = None
        self.nccl: nccl.NcclCommunicator | None = None
        self._patch: PatchKernel | None = None
        self._regions: dict[str, _RegionGraphs] = {}
        self._per_shape: OrderedDict[tuple, CapturedGraph] = OrderedDict()
        check(driver.cuInit(0), "cuInit")
        self._cu_device = check(driver.cuDeviceGet(device.index), "cuDeviceGet")
        self._context = check(driver.cuDevicePrimaryCtxRetain(self._cu_device),
                              "cuDevicePrimaryCtxRetain")
        check(driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
        major = check(driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            self._cu_device), "cuDeviceGetAttribute")
        minor = check(driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            self._cu_device), "cuDeviceGetAttribute")
        self.arch = arch or f"sm_{major}{minor}"
        self.cubins = cubins or CubinStore(self.arch)
        version = check(driver.cuDriverGetVersion(), "cuDriverGetVersion")
        if mode == "topology" and version < DEVICE_UPDATE_DRIVER:
            self.mode = "per-shape"
            self.fallback_reason = (f"the driver supports CUDA {version // 1000}.{version % 1000 // 10}; "
                                    "device-updatable graph nodes need 12.4: one graph per shape")
        # Calls run on a blocking stream, so they order with TVM's copies on the legacy
        # default stream; captures happen on a stream of their own that never runs work.
        self.stream = check(driver.cuStreamCreate(0), "cuStreamCreate")
        self.capture_stream = check(
            driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        if CUBLASLT in libraries:
            # The library's handle and workspace are this backend's: its captures use them.
            register_functions()
            self.cublaslt = CublasLt(device.index)
        attention_sources = attention.sources_of(libraries)
        if attention_sources:  # loaded now: a capture cannot load a module
            attention.register_functions()
            self.attention = attention.FusedAttention(self.cubins, attention_sources)
        self._needs_nccl = nccl.LIBRARY in libraries  # its regions call grape.nccl.*
        if collectives is not None:
            self.join_collectives(collectives)
        self._layouts: dict[int, list[tuple[int, int]]] = {}  # CUfunction -> parameter layout
        self.graphs_captured = 0
        self.graphs_instantiated = 0
        self.launches = 0  # graph launches, for the executor's statistics
        self.driver_ns = 0  # time in the driver's copy and launch calls of replays
        self.synchronizing_guards = 0  # guards read on the host (per-shape mode): each a sync
        self.graphs_not_kept = 0  # captures run once and dropped (``UnkeptGraph``)
        self.memsets_as_kernels = 0  # memset nodes of topology-mode captures made grape_fill
        # Kernel nodes of topology graphs launched in clusters of several blocks (a cuBLAS
        # kernel that keeps its clusters): a device-side grid update slows and breaks such a
        # node, so its grid is part of the topology (cuda_graph.node_records).
        self.cluster_kernel_nodes = 0
        self.not_kept_reason: str | None = None
        self._evicted_graphs = 0
        # Device memory taken by graphs and their tables: free memory read just before and
        # after each instantiation, table write and release (nothing else allocates there).
        self.graph_device_bytes = 0

    def join_collectives(self, group: nccl.CollectiveGroup) -> None:
        """Make this rank's NCCL communicator, with the group's other ranks (all at once):
        the graphs' collectives (``grape.nccl.*``) and a session's transfers run on it. An
        artifact whose regions call them cannot run until it is made."""
        if self.nccl is not None:
            raise nccl.NcclError("this backend already has its NCCL communicator")
        check(driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")  # NCCL's device
        self.nccl = nccl.NcclCommunicator(group)

    # -- the executor's interface --------------------------------------------------------
    def stream_context(self):
        """TVM launches everything of a call on the backend's stream."""
        return self._on_stream(self.stream)

    def capture_context(self):
        """TVM launches on the capture stream (a caller capturing into a graph of its own)."""
        return self._on_stream(self.capture_stream)

    @contextlib.contextmanager
    def _on_stream(self, stream):
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._use_stream(self.device, int(stream)))
            # Library calls the VM makes meanwhile run with this backend's state.
            for library in self._libraries():
                stack.enter_context(library.active())
            yield

    def _libraries(self) -> list:
        """The runtime libraries this backend holds (``runtime/libraries.py``'s)."""
        return [lib for lib in (self.cublaslt, self.attention, self.nccl) if lib is not None]

    @property
    def context(self):
        """The CUcontext the backend's graphs and streams belong to."""
        return self._context

    def has(self, region: str, shape: tuple) -> bool:
        graphs = self._regions.get(region)
        return (graphs is not None and shape in graphs.groups.where) or \
            (region, shape) in self._per_shape

    @property
    def shapes_held(self) -> int:
        """(region, shape) recordings held now: rows of argument tables, per-shape graphs."""
        return sum(len(r.groups.where) for r in self._regions.values()) + len(self._per_shape)

    @property
    def evicted(self) -> int:
        """Recordings given up so far to stay within ``max_shapes`` / ``max_graphs``."""
        return sum(r.groups.evicted for r in self._regions.values()) + self._evicted_graphs

    def replay(self, region: str, shape: tuple, region_args: Sequence[Any],
               caller: Any = None, moving: Sequence[int] | None = None,
               guards: Sequence[tuple[Any, Any]] = ()) -> bool:
        """Launch the recording of ``region`` at ``shape``; False if there is none.

        ``caller``/``moving``: see ``TopologyGraph.replay`` (a planned call passes them).
        ``guards``: ``(tensor or device address, expect)`` pairs; the region runs only if
        each 1-byte condition is ``expect`` (nonzero counts as 1). True also when a guard
        failed: the recording exists, the call is done.
        """
        graphs = self._regions.get(region)
        found = graphs.groups.lookup(shape) if graphs is not None else None
        if found is not None:
            table, row = found
            graph = graphs.graphs[table]
            nbytes = graph.launch_record(row, region_args, caller, moving, guards)
            start = time.perf_counter_ns()
            graph.launch(nbytes, self.stream)
            self.driver_ns += time.perf_counter_ns() - start
            self.launches += 1
            return True
        captured = self._per_shape.get((region, shape))
        if captured is None:
            return False
        self._per_shape.move_to_end((region, shape))
        if guards and not self._guards_hold(guards):
            return True
        start = time.perf_counter_ns()
        captured.replay(region_args, self.stream)
        self.driver_ns += time.perf_counter_ns() - start
        self.launches += 1
        return True

    def ready(self, region: str, shape: tuple) -> "ReadyLaunch | None":
        """The launch of ``region`` at ``shape`` just replayed, to be made again as it was
        (``ReadyLaunch``). None in per-shape mode, whose replays re-point nodes from the
        host anyway, and for a guarded launch: a failed guard leaves the graph's nodes
        disabled from the device, and whether a host-side update of the graph keeps that
        is not documented (``TopologyGraph.launch_ready``)."""
        graphs = self._regions.get(region)
        found = graphs.groups.where.get(shape) if graphs is not None else None
        if found is None:
            return None
        graph = graphs.graphs[found[0]]
        if graph.launch_guarded:
            return None
        return ReadyLaunch(self, graph, graph.ready_record(self.stream), graphs.groups, shape)

    def _guards_hold(self, guards: Sequence[tuple[Any, Any]]) -> bool:
        """Read the guards on the host: a per-shape graph has no patch kernel to skip its
        nodes. The conditions come from work queued before: wait for it first."""
        self.synchronize()
        value = bytearray(1)
        for where, expect in guards:
            check(driver.cuMemcpyDtoH(value, guard_address(where), 1), "cuMemcpyDtoH(guard)")
            self.synchronizing_guards += 1
            if bool(value[0]) != bool(expect):
                return False
        return True

    def begin(self, region: str, shape: tuple, region_args: Sequence[Any]) -> Capture:
        if self._needs_nccl and self.nccl is None:  # before a capture it would abandon
            raise nccl.NcclError("this artifact's regions call NCCL's collectives: each rank "
                                 "joins its group first (load(..., collectives="
                                 "CollectiveGroup(...)); grape_tvm.load_tensor_parallel does "
                                 "this)")
        ctx = self.capture_context()
        check(driver.cuStreamBeginCapture(
            self.capture_stream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
            "cuStreamBeginCapture")
        ctx.__enter__()
        return Capture(region, shape, region_args, ctx)

    def end(self, capture: Capture, run: bool = True) -> None:
        """Finish a capture, keep what it recorded, and run it (capture runs nothing) unless
        ``run`` is False: a branch not taken is recorded without its side effects."""
        capture.stream_context.__exit__(None, None, None)
        graph = check(driver.cuStreamEndCapture(self.capture_stream), "cuStreamEndCapture")
        self.graphs_captured += 1
        if run:
            self.launches += 1  # the capture's own run, below
        try:
            nodes = read_nodes(graph, self._layouts)
            check_memsets(nodes.memsets, capture.region_args)
        except UnkeptGraph as reason:
            self._run_once(capture, graph, run, reason)
            return
        except BaseException:
            driver.cuGraphDestroy(graph)
            raise
        if self.mode == "topology":
            self._keep_in_topology(capture, graph, nodes, run)
        else:
            self._keep_per_shape(capture, graph, nodes, run)

    def _run_once(self, capture: Capture, graph, run: bool, reason: UnkeptGraph) -> None:
        """A graph that cannot serve later calls: run it for this call and drop it. The shape
        stays unrecorded, so each call at it captures again (correct, not fast)."""
        self.graphs_not_kept += 1
        self.not_kept_reason = f"{capture.region}: {reason}"
        once = OwnedGraph()
        once.graph = graph
        try:
            if run:
                once.instantiate(self.stream)
                check(driver.cuGraphLaunch(once.exec, self.stream), "cuGraphLaunch")
                # A rare path: wait, rather than rely on the driver's deferred destruction
                # of an executing graph.
                self.synchronize()
        finally:
            once.close()

    def abort(self, capture: Capture) -> None:
        capture.stream_context.__exit__(None, None, None)
        err, graph = driver.cuStreamEndCapture(self.capture_stream)
        if err == driver.CUresult.CUDA_SUCCESS and graph is not None:
            driver.cuGraphDestroy(graph)

    # -- topology mode -------------------------------------------------------------------
    def _patch_kernel(self) -> PatchKernel:
        if self._patch is None:
            self._patch = PatchKernel(self.cubins)
        return self._patch

    def _keep_in_topology(self, capture: Capture, graph, nodes_read: CapturedNodes,
                          run: bool) -> None:
        patch = self._patch_kernel()
        if nodes_read.memsets:  # as kernels: their address and size are patched per shape
            try:
                self.memsets_as_kernels += memsets_as_kernels(
                    graph, list(zip(nodes_read.memset_nodes, nodes_read.memsets)), patch.fill)
                nodes_read = read_nodes(graph, self._layouts)
            except BaseException:
                driver.cuGraphDestroy(graph)
                raise
        nodes = nodes_read.kernels
        slots = find_pointer_slots(nodes, capture.region_args)
        records = node_records(nodes, slots)
        region = self._regions.setdefault(
            capture.region, _RegionGraphs(TopologyGroups(self.max_shapes), []))
        placed = region.groups.add(capture.shape, records)
        free = _free_bytes()
        if placed.new_table:
            pointer_map = [(s.node, s.param, s.arg, s.delta) for s in slots]
            topology_graph = TopologyGraph(
                graph, nodes, [n.layout for n in nodes], pointer_map,
                region.groups.tables[placed.table], len(capture.region_args), patch, self.stream,
                captured_args=capture.region_args)
            region.graphs.append(topology_graph)
            self.graphs_instantiated += 1
            self.cluster_kernel_nodes += sum(n.cluster_blocks > 1 for n in nodes)
        else:
            driver.cuGraphDestroy(graph)  # the group's graph serves this shape too
            topology_graph = region.graphs[placed.table]
            topology_graph.refresh(placed.row if placed.reused_row else None)
        self.graph_device_bytes += free - _free_bytes()
        if run:
            topology_graph.replay(placed.row, capture.region_args, self.stream)

    # -- per-shape mode ------------------------------------------------------------------
    def _keep_per_shape(self, capture: Capture, graph, nodes_read: CapturedNodes,
                        run: bool) -> None:
        nodes = nodes_read.kernels
        slots = find_pointer_slots(nodes, capture.region_args)
        free = _free_bytes()
        captured = CapturedGraph(graph, nodes, slots, capture.region_args, self.stream)
        self.graph_device_bytes += free - _free_bytes()
        self.graphs_instantiated += 1
        self._per_shape[(capture.region, capture.shape)] = captured
        while len(self._per_shape) > self.max_graphs:
            _, old = self._per_shape.popitem(last=False)
            free = _free_bytes()
            old.close()
            self.graph_device_bytes -= _free_bytes() - free
            self._evicted_graphs += 1
        if run:
            captured.replay(capture.region_args, self.stream)

    # -- what is held ----------------------------------------------------------------------
    def recorded_shapes(self) -> dict[str, list[tuple]]:
        shapes = {name: list(r.groups.where) for name, r in self._regions.items()}
        for region, shape in self._per_shape:
            shapes.setdefault(region, []).append(shape)
        return shapes

    def synchronize(self) -> None:
        check(driver.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def describe(self) -> dict:
        regions = {name: [dict(g, graph_table_device_bytes=r.graphs[i].device_bytes(),
                               device_updatable_nodes=len(r.graphs[i].updatable))
                          for i, g in enumerate(r.groups.describe())]
                   for name, r in self._regions.items()}
        return {"backend": self.name, "mode": self.mode, "fallback_reason": self.fallback_reason,
                "graphs_captured": self.graphs_captured,
                "graphs_instantiated": self.graphs_instantiated,
                "per_shape_graphs": len(self._per_shape), "evicted": self.evicted,
                "graph_device_bytes": self.graph_device_bytes,
                "synchronizing_guards": self.synchronizing_guards,
                "graphs_not_kept": self.graphs_not_kept, "not_kept_reason": self.not_kept_reason,
                "memsets_as_kernels": self.memsets_as_kernels,
                "cluster_kernel_nodes": self.cluster_kernel_nodes,
                "cublaslt_algorithms": dict(self.cublaslt.chosen) if self.cublaslt else {},
                "topology_groups": regions}

    def __del__(self):
        try:
            if hasattr(self, "_regions"):  # __init__ got as far as owning something
                self.close()
        except Exception:  # pylint: disable=broad-except
            pass  # interpreter shutdown: the driver may already be gone

    def close(self) -> None:
        """Free every graph, table, stream and the context reference; idempotent."""
        for region in self._regions.values():
            for graph in region.graphs:
                graph.close()
        self._regions.clear()
        for graph in self._per_shape.values():
            graph.close()
        self._per_shape.clear()
        if self._patch is not None:
            self._patch.close()
            self._patch = None
        for library in self._libraries():
            library.close()
        self.cublaslt = self.attention = self.nccl = None
        for stream in (self.stream, self.capture_stream):
            if stream is not None:
                driver.cuStreamDestroy(stream)
        self.stream = self.capture_stream = None
        if self._context is not None:
            driver.cuDevicePrimaryCtxRelease(self._cu_device)
            self._context = None
