"""One CUDA graph per topology, patched from the device by the patch kernel.

``TopologyGraph`` owns, for one group of shapes that launch the same kernels with the same
block dims: the graph captured at the group's first shape, its instantiation, and the device
buffers of its argument table. A ``PatchKernel`` node at the head applies the current shape's
row (grid dims, scalar parameters) and the current call's argument addresses to the kernel
nodes that need them, which alone are device-updatable (the attribute slows a node's
launch). A call that changes the row, moves an argument or changes its guards writes its
launch record (row index, argument addresses, guards) with one stream-ordered copy, and
launches: no capture, no instantiation, no host-side update of a kernel node. A call made
again (an earlier call's very inputs) instead points the patch node at the record that
call kept on the device (``ReadyRecord``): one host-side update of that node alone.
The patch kernel applies only what differs from the launch before.

A launch may carry guards (predication): device-resident 1-byte conditions and the values
they must hold, read by the patch kernel when the graph runs. If one fails, the patch kernel
disables the region's kernel nodes and the launch runs no kernel: a data-dependent ``if``
launches both branches, each guarded by the condition, with no host sync. A library's
memsets (into its own workspace: ``cuda_graph.check_memsets`` keeps no other) run as
``grape_fill`` kernels, skipped with the rest.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from tvm.runtime import Tensor

from .argument_table import ArgumentTable
from .call_plan import Address
from .call_program import MAX_GUARDS  # guards per launch: how deep a region may nest in ifs
from .cuda_compile import CubinStore, RuntimeKernel, kernel_params
from .cuda_driver import SUCCESS, check, driver
from .cuda_graph import OwnedGraph, add_head_node, address_of

MAX_PARAM_BYTES = 16  # the widest kernel parameter a column may patch
# Dynamic shared memory the patch kernel stages into, at most: 48 KiB a block without an
# opt-in, less the kernel's few bytes of static shared memory.
STAGED_BYTES = 48 * 1024 - 256
STAGE_ARGS, STAGE_POINTERS = 1, 2  # what it stages (patch.cu)
POINTER_BYTES = 24  # one entry of ``pointers`` (encode_pointers)
NO_ROW = 0xFFFFFFFF  # state.applied_row before anything was applied
NO_GENERATION = 0  # state.applied_generation before anything was applied (records count from 1)
# The launch record's header (patch.cu's Launch): where each u32 field sits, and its size.
ROW_AT, NUM_GUARDS_AT, GENERATION_AT, ARGS_AT = 0, 4, 8, 16
NODES_UNKNOWN = 0xFFFFFFFF  # state.nodes when the nodes' enabled state is not known
GUARD = struct.Struct("<QQ")  # {u64 address, u64 expect}
PATCH_SOURCE = Path(__file__).with_name("kernels") / "patch.cu"
# Launch records of calls made again (``TopologyGraph.launch_ready``) kept on the device per
# graph: a call switches to one by pointing the patch node at it, no copy. More than the
# input sets an executor keeps (9: its last call's and RECENT_TENSORS), each launching a
# graph once; a record whose slot went to another is copied into one again when used.
READY_SLOTS = 16


FILL_BLOCK = 256  # threads per block of grape_fill
FILL_MAX_BLOCKS = 1024


class PatchKernel(RuntimeKernel):
    """The compiled patch kernel, loaded once per backend, and ``grape_fill`` of the same
    module (``memsets_as_kernels``)."""

    def __init__(self, store: CubinStore):
        super().__init__(store, PATCH_SOURCE, "grape_patch")
        self.fill = check(driver.cuModuleGetFunction(self.module, b"grape_fill"),
                          "cuModuleGetFunction(grape_fill)")


def memsets_as_kernels(graph, memsets: Sequence[Any], fill) -> int:
    """Replace each memset node of a captured ``graph`` (``memsets``: the nodes, with the
    ``MemsetNode`` read from each) by a launch of ``grape_fill`` that writes the same bytes,
    with the same dependencies. Return how many were replaced.

    A memset node's address and size are fixed in a graph, so memsets that follow M
    (cuBLASLt's split-K counters) made every M its own topology; as kernel parameters and
    a grid they are fields of the argument table, patched per shape.

        before: gemm_kernel -> memset(ws + 4096, 0, 96 x 4 B) -> split_k_reduce
        after:  gemm_kernel -> grape_fill(ws + 4096, 0, 96, 4) -> split_k_reduce
    """
    for node, m in memsets:
        deps = _neighbours(driver.cuGraphNodeGetDependencies, node)
        dependents = _neighbours(driver.cuGraphNodeGetDependentNodes, node)
        storage = kernel_params([("u64", m.dst), ("u64", m.pitch), ("u64", m.width),
                                 ("u64", max(m.height, 1)), ("u32", m.value),
                                 ("u32", m.element_size)])
        params = kernel_node_params(fill, fill_blocks(m.width * max(m.height, 1)), FILL_BLOCK, 0,
                                    storage)
        kernel = check(driver.cuGraphAddKernelNode(graph, deps, len(deps), params),
                       "cuGraphAddKernelNode(grape_fill)")
        if dependents:
            check(driver.cuGraphAddDependencies(graph, [kernel] * len(dependents), dependents,
                                                None, len(dependents)),
                  "cuGraphAddDependencies(grape_fill)")
        check(driver.cuGraphDestroyNode(node), "cuGraphDestroyNode(memset)")
    return len(memsets)


def fill_blocks(elements: int) -> int:
    """``grape_fill``'s grid for ``elements`` elements (``FILL_BLOCK`` threads a block)."""
    return min(max(-(-elements // FILL_BLOCK), 1), FILL_MAX_BLOCKS)


def _neighbours(query, node) -> list:
    """A node's dependencies or dependents (``query``), in two calls: count, then list."""
    *_, count = check(query(node, 0), query.__name__)
    if not count:
        return []
    found, _, count = check(query(node, count), query.__name__)
    return list(found[:count])


class DeviceBuffer:
    """A device allocation with one owner; grows by reallocation."""

    def __init__(self, nbytes: int):
        self.nbytes = max(nbytes, 16)
        self.ptr = check(driver.cuMemAlloc(self.nbytes), "cuMemAlloc")

    def write(self, data: bytes) -> bool:
        """Copy ``data`` in (synchronously); return True if the buffer had to move."""
        moved = False
        if len(data) > self.nbytes:
            driver.cuMemFree(self.ptr)
            self.nbytes = max(len(data), 2 * self.nbytes)
            self.ptr = check(driver.cuMemAlloc(self.nbytes), "cuMemAlloc")
            moved = True
        if data:
            check(driver.cuMemcpyHtoD(self.ptr, data, len(data)), "cuMemcpyHtoD")
        return moved

    def write_at(self, offset: int, data: bytes) -> None:
        """Copy ``data`` in at ``offset``; the caller made sure it fits."""
        if data:
            check(driver.cuMemcpyHtoD(int(self.ptr) + offset, data, len(data)), "cuMemcpyHtoD")

    @property
    def address(self) -> int:
        return int(self.ptr)

    def close(self) -> None:
        if self.ptr is not None:
            driver.cuMemFree(self.ptr)
            self.ptr = None


def _align(size: int) -> int:
    """Alignment of a column's value in a row: the device copies 8-byte values as such."""
    return 8 if size >= 8 else 4


def encode_table(table: ArgumentTable, layouts: Sequence[Sequence[tuple[int, int]]]
                 ) -> tuple[bytes, bytes, int, dict[int, tuple[int, int]]]:
    """The patch kernel's ``columns``, ``rows``, row size and each node's column span
    (layout in kernels/patch.cu).

    Field 0 of a node is its grid (kind 1, 12 bytes); field i > 0 is kernel parameter i - 1
    (kind 0), patched at its offset in the parameter buffer (``cuFuncGetParamInfo``). A row
    packs each column's value at an offset aligned for its size (8 bytes for 8-byte values,
    else 4); rows are 8-byte aligned. Column descriptors are grouped by node, one patch
    thread per node.
    """
    placement = _placement(table, layouts)
    described = []
    for (node, field), (_, at) in zip(table.columns, placement):
        if field == 0:
            kind, offset, size = 1, 0, 12
        else:
            kind, (offset, size) = 0, layouts[node][field - 1]
            if size > MAX_PARAM_BYTES:
                raise ValueError(f"a {size}-byte kernel parameter varies across shapes; the "
                                 f"patch kernel patches up to {MAX_PARAM_BYTES} bytes")
        described.append((node, kind, offset, size, at))
    end = max((at + size for *_, size, at in described), default=0)
    row_bytes = max((end + 7) // 8 * 8, 8)
    rows = b"".join(encode_row(table.row(r), placement, row_bytes) for r in range(len(table)))
    described.sort(key=lambda d: d[0])  # stable: a node's columns stay in table order
    columns = b"".join(struct.pack("<8I", *d, 0, 0, 0) for d in described)
    return columns, rows, row_bytes, _spans([d[0] for d in described])


def _placement(table: ArgumentTable, layouts) -> list[tuple[int, int]]:
    """(field, value offset) of each column, in table order, as ``encode_table`` packs them."""
    out, at = [], 0
    for node, field in table.columns:
        size = 12 if field == 0 else layouts[node][field - 1][1]
        align = 4 if field == 0 else _align(size)
        at = (at + align - 1) // align * align
        out.append((field, at))
        at += size
    return out


def encode_row(values: Sequence[Any], placement: Sequence[tuple[int, int]], row_bytes: int) -> bytes:
    row = bytearray(row_bytes)
    for (field, at), value in zip(placement, values):
        raw = struct.pack("<III", *value) if field == 0 else bytes(value)
        row[at:at + len(raw)] = raw
    return bytes(row)


def encode_pointers(pointer_map: Sequence[tuple[int, int, int, int]],
                    layouts: Sequence[Sequence[tuple[int, int]]]
                    ) -> tuple[bytes, dict[int, tuple[int, int]]]:
    """The patch kernel's ``pointers`` (node, param offset, region argument, delta), grouped
    by node, and each node's span of them."""
    ordered = sorted(pointer_map, key=lambda p: p[0])
    data = b"".join(struct.pack("<IIIIQ", node, layouts[node][param][0], arg, 0, delta)
                    for node, param, arg, delta in ordered)
    return data, _spans([p[0] for p in ordered])


def encode_spans(nodes: Sequence[int], columns: dict[int, tuple[int, int]],
                 pointers: dict[int, tuple[int, int]]) -> bytes:
    """``spans[i]`` = (first column, columns, first pointer, pointers) of node ``nodes[i]``:
    the patch kernel's i-th node (it updates only the device-updatable ones)."""
    return b"".join(struct.pack("<4I", *columns.get(n, (0, 0)), *pointers.get(n, (0, 0)))
                    for n in nodes)


def _spans(nodes_in_order: Sequence[int]) -> dict[int, tuple[int, int]]:
    spans: dict[int, tuple[int, int]] = {}
    for i, node in enumerate(nodes_in_order):
        first, count = spans.get(node, (i, 0))
        spans[node] = (first, count + 1)
    return spans


def make_device_updatable(node) -> int:
    """Opt a kernel node into device-side updates; return its device handle."""
    attr = driver.CUkernelNodeAttrID.CU_LAUNCH_ATTRIBUTE_DEVICE_UPDATABLE_KERNEL_NODE
    value = driver.CUkernelNodeAttrValue()
    value.deviceUpdatableKernelNode.deviceUpdatable = 1
    check(driver.cuGraphKernelNodeSetAttribute(node, attr, value),
          "cuGraphKernelNodeSetAttribute(device updatable)")
    got = check(driver.cuGraphKernelNodeGetAttribute(node, attr), "cuGraphKernelNodeGetAttribute")
    return int(got.deviceUpdatableKernelNode.devNode)


def patch_staging(num_args: int, num_pointers: int) -> tuple[int, int]:
    """What the patch kernel stages in shared memory, and the bytes: args and applied
    (8 bytes each per argument), then the pointers, as far as ``STAGED_BYTES`` allows."""
    args = 16 * num_args
    if args + POINTER_BYTES * num_pointers <= STAGED_BYTES:
        return STAGE_POINTERS, args + POINTER_BYTES * num_pointers
    if args <= STAGED_BYTES:
        return STAGE_ARGS, args
    return 0, 0


def kernel_node_params(function, blocks: int, threads: int, shared_bytes: int, storage):
    """A 1-D kernel node of one of the runtime's kernels, its parameters in ``storage``
    (``kernel_params``, alive until the node is added or set)."""
    params = driver.CUDA_KERNEL_NODE_PARAMS()
    params.func = function
    params.gridDimX, params.gridDimY, params.gridDimZ = blocks, 1, 1
    params.blockDimX, params.blockDimY, params.blockDimZ = threads, 1, 1
    params.sharedMemBytes = shared_bytes
    params.kernelParams = ctypes.addressof(storage[1])
    return params


def guard_address(where: Any) -> int:
    """The device address of a guard: a tensor's ``data_ptr()``, or an ``int`` address."""
    address = where if isinstance(where, int) else address_of(where)
    if not isinstance(address, int) or address == 0:
        raise ValueError(f"a guard is a tensor or a nonzero device address, got {where!r}")
    return address


_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class LaunchRecord:
    """The host copy of the patch kernel's launch record (layout in kernels/patch.cu):
    ``{u32 shape_row, u32 num_guards, u32 generation, u32 pad, u64 args[max(num_args, 1)],
    guards[num_guards]}``, a guard being ``{u64 address, u64 expect}``; room for
    ``MAX_GUARDS`` guards.

    It knows what the device holds (what it gave last): ``point`` and ``set_guards``
    compare with what the record holds and mark it changed only if it did, and ``take()``
    says how many bytes a call must copy (0: none), so that a call queues a copy only if
    the record changed. Each changed record taken gets the next ``generation`` (from 1,
    never ``NO_GENERATION``): the patch kernel returns at once when it applied that
    generation already.
    The bytes live at a fixed host ``address`` for the whole life of the record: the copy
    reads them there, with no bytes object made per call.
    """

    def __init__(self, num_args: int, captured_args: Sequence[Any] = ()):
        # The kernel finds the guards after max(num_args, 1) slots too: keep them agreeing.
        self.guards_at = ARGS_AT + 8 * max(num_args, 1)
        self.capacity = self.guards_at + GUARD.size * MAX_GUARDS  # bytes the device needs
        self.data = bytearray(self.capacity)
        # The address of ``data`` as an int: cuda-python takes an int pointer as it is (an
        # object with the buffer protocol costs it a failed int conversion first). The
        # ctypes view holds an export of ``data``, so it can never be resized or moved.
        # (Pageable memory: the driver stages a copy from it before returning.)
        self._view = (ctypes.c_char * self.capacity).from_buffer(self.data)
        self.address = ctypes.addressof(self._view)
        self.num_guards = 0
        self.generation = NO_GENERATION
        self._row = 0
        # ``captured_args``: the arguments the graph was captured with (their addresses are
        # what its nodes hold); a position in ``watched`` that moves from there is kept in
        # ``moved``
        self._args = [0] * max(num_args, 1)
        for i, arg in enumerate(captured_args[:len(self._args)]):
            self._args[i] = address_of(arg)
            _U64.pack_into(self.data, ARGS_AT + 8 * i, self._args[i])
        self.watched: frozenset = frozenset()
        self.moved: list[int] = []
        self._guards: tuple = ()
        self._changed = True  # the device holds nothing yet

    def point(self, row: int, region_args: Sequence[Any], positions: Sequence[int]) -> int:
        """Set the row and the addresses of the arguments at ``positions``, then ``take()``:
        an executor buffer's ``Address`` is its own value, a tensor's is its ``data_ptr()``,
        a dim passed by value has none (0)."""
        data, held = self.data, self._args
        if row != self._row:
            self._row = row
            _U32.pack_into(data, ROW_AT, row)
            self._changed = True
        for i in positions:
            arg = region_args[i]
            kind = type(arg)  # exact types first: hasattr costs more than data_ptr() itself
            if kind is Address:
                address = arg
            elif kind is Tensor:
                address = arg.data_ptr()
            else:
                address = address_of(arg)
            if address != held[i]:
                held[i] = address
                _U64.pack_into(data, ARGS_AT + 8 * i, address)
                self._changed = True
                if i in self.watched:
                    self.moved.append(i)
        return self.take()

    def set_guards(self, guards: Sequence[tuple[Any, Any]]) -> None:
        """``guards``: ``(tensor or address, expect)``; ``expect`` is stored as 0 or 1."""
        if not guards and not self.num_guards:
            return
        if len(guards) > MAX_GUARDS:
            raise ValueError(f"{len(guards)} guards: a region nests in at most {MAX_GUARDS} "
                             f"data-dependent ifs (the patch kernel's launch record holds "
                             f"{MAX_GUARDS} guards)")
        packed = tuple((guard_address(where), 1 if expect else 0) for where, expect in guards)
        if packed == self._guards:  # all checked first: a refused call changes nothing
            return
        for g, guard in enumerate(packed):
            GUARD.pack_into(self.data, self.guards_at + GUARD.size * g, *guard)
        self._guards = packed
        self.num_guards = len(packed)
        _U32.pack_into(self.data, NUM_GUARDS_AT, self.num_guards)
        self._changed = True

    @property
    def used_bytes(self) -> int:
        """The record's length as the kernel reads it: guards past ``num_guards`` are not."""
        return self.guards_at + GUARD.size * self.num_guards

    def used(self) -> bytes:
        """The record as the kernel reads it."""
        return bytes(self.data[:self.used_bytes])

    def take(self) -> int:
        """The bytes a call must copy from ``address`` (``used_bytes``) if the record changed
        since the last ``take``, else 0; the device holds it from then on."""
        if not self._changed:
            return 0
        self._changed = False
        self.generation = self.generation % 0xFFFFFFFF + 1  # 1 .. 2**32 - 1, then 1 again
        _U32.pack_into(self.data, GENERATION_AT, self.generation)
        return self.used_bytes

    def pending(self) -> bytes | None:
        """The bytes ``take()`` says to copy, or None."""
        return self.used() if self.take() else None


@dataclass(frozen=True)
class _PatchNodeParams:
    """The patch node's parameters, and the ctypes storage its kernelParams point into."""

    storage: Any
    params: Any


class ReadyRecord:
    """A launch record as one launch left it (``TopologyGraph.ready_record``), copied into
    a slot of the graph's ``ready`` buffer: a call that repeats that launch (same row,
    arguments and guards) points the patch node at the slot and launches. The generation
    comes with the bytes and stands for exactly this content, so the patch kernel skips
    its work when it applied this very record last, and applies what differs when another
    came in between."""

    __slots__ = ("data", "address", "nbytes", "slot")

    def __init__(self, record: LaunchRecord):
        used = record.used()
        self.data = ctypes.create_string_buffer(used, len(used))
        self.address = ctypes.addressof(self.data)  # an int: see LaunchRecord.address
        self.nbytes = len(used)
        self.slot = -1  # its slot in the graph's ``ready`` buffer, if it still holds it


class TopologyGraph(OwnedGraph):
    """The one graph of a topology group, with its argument table on the device.

    Only the kernel nodes the patch kernel must update are device-updatable: on every node
    the attribute cost the 24-block model 10.2 us a launch over 72 nodes on the H200
    (bench/README.md, fifth session of 2026-12-02). Those are the nodes with a column in
    the table, the nodes that hold the address of an argument that has moved since the
    capture, and every node once a launch is guarded (a failed guard disables them all). A
    node joins them when that first happens: the graph is instantiated again, once per
    such change.
    """

    def __init__(self, graph, nodes, layouts: list[list[tuple[int, int]]],
                 pointer_map: list[tuple[int, int, int, int]], table: ArgumentTable,
                 num_args: int, patch: PatchKernel, stream, captured_args: Sequence[Any] = ()):
        self.graph = graph
        self.table = table
        self.layouts = layouts
        self.stream = stream
        self.patch = patch
        self.num_args = num_args
        self._last_caller: Any = None
        # Records of calls made again, by slot of ``buffers["ready"]`` (``launch_ready``),
        # and the one the patch node reads now (None: the launch buffer, ``_launch``'s).
        self._slots: list[ReadyRecord | None] = [None] * READY_SLOTS
        self._next_slot = 0
        self._reading: ReadyRecord | None = None
        # The patch node's parameters by the address it reads its record at; made again
        # when the table's buffers move (``_make_updatable``, ``refresh``).
        self._patch_node_params_at: dict[int, _PatchNodeParams] = {}
        self._graph_nodes = [n.node for n in nodes]
        self._pointer_map = pointer_map
        # node index -> its device handle, for the device-updatable nodes
        self._device_nodes: dict[int, int] = {}
        # The launch record: its host copy, which knows what the device holds (the last copy
        # queued), so that a call queues a copy only if the record changed. Its device buffer
        # has room for every guard from the start: the patch node holds its address, and a
        # call's copy (``replay``) writes as many guards as the call has, unchecked.
        self._launch = LaunchRecord(num_args, captured_args)
        self.buffers = {name: DeviceBuffer(self._launch.capacity if name == "launch" else 16)
                        for name in ("columns", "rows", "pointers", "spans", "launch", "applied",
                                     "state", "nodes")}
        self.buffers["launch"].write(self._launch.pending())
        self._slot_bytes = -(-self._launch.capacity // 16) * 16
        self.buffers["ready"] = DeviceBuffer(READY_SLOTS * self._slot_bytes)
        # The launch buffer is allocated once and never moves. Its CUdeviceptr as it is:
        # cuda-python would make a new one from an int on every call.
        self._launch_device = self.buffers["launch"].ptr
        pointers, self._pointer_spans = encode_pointers(pointer_map, layouts)
        self.buffers["pointers"].write(pointers)
        self.num_pointers = len(pointer_map)
        self.stage, self.staged_bytes = patch_staging(num_args, self.num_pointers)
        self._choose_updatable(self._column_nodes())
        self._encode_table()
        self.patch_node = self._add_patch_node(graph)
        self.instantiate(stream)

    @property
    def launch_guarded(self) -> bool:
        """Whether the last launch written carried guards."""
        return self._launch.num_guards > 0

    @property
    def updatable(self) -> list[int]:
        """The device-updatable nodes, in the order of the patch kernel's ``nodes``."""
        return sorted(self._device_nodes)

    # -- building ----------------------------------------------------------------------
    def _column_nodes(self) -> set[int]:
        return {node for node, _ in self.table.columns}

    def _choose_updatable(self, nodes) -> None:
        """Make ``nodes`` device-updatable too (the graph must not be instantiated), and
        watch the arguments that the other nodes hold."""
        for n in set(nodes) - self._device_nodes.keys():
            self._device_nodes[n] = make_device_updatable(self._graph_nodes[n])
        handles = [self._device_nodes[n] for n in self.updatable]
        self.buffers["nodes"].write(struct.pack(f"<{len(handles)}Q", *handles))
        self._launch.watched = frozenset(arg for node, _, arg, _ in self._pointer_map
                                         if node not in self._device_nodes)

    def _make_updatable(self, nodes) -> None:
        """Make ``nodes`` device-updatable in the instantiated graph: instantiated again,
        after the launches in flight, with the table encoded for the new node list."""
        if set(nodes) <= self._device_nodes.keys():
            return
        check(driver.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
        check(driver.cuGraphExecDestroy(self.exec), "cuGraphExecDestroy")
        self.exec = None
        self._choose_updatable(nodes)
        self._encode_table()
        check(driver.cuGraphKernelNodeSetParams(self.patch_node, self._new_patch_node_params()),
              "cuGraphKernelNodeSetParams(patch)")
        self.instantiate(self.stream)

    def _patch_params(self, launch: int):
        b = self.buffers
        return kernel_params([
            ("u64", b["columns"].address), ("u64", b["rows"].address), ("u32", self._row_bytes),
            ("u64", b["pointers"].address), ("u64", b["spans"].address),
            ("u32", len(self.updatable)), ("u64", launch),
            ("u64", b["applied"].address), ("u32", self.num_args),
            ("u64", b["state"].address), ("u64", b["nodes"].address),
            ("u32", self.num_pointers), ("u32", self.stage)])

    def _patch_node_params(self, launch: int | None = None):
        """The patch node reading its launch record at ``launch`` (the launch buffer if
        None); kept, with the ctypes storage its kernelParams point into."""
        launch = self.buffers["launch"].address if launch is None else launch
        found = self._patch_node_params_at.get(launch)
        if found is None:
            storage = self._patch_params(launch)
            # A thread per node (bench/results/patch_variants.json: one thread making every
            # update costs about 1 us per update; a thread per node hides it).
            threads = min(256, max(32, (len(self.updatable) + 31) // 32 * 32))
            found = self._patch_node_params_at[launch] = _PatchNodeParams(
                storage, kernel_node_params(self.patch.function, 1, threads, self.staged_bytes,
                                            storage))
        return found.params

    def _new_patch_node_params(self):
        """The patch node's parameters after the table's buffers moved: made again, the
        node reading the launch buffer (the caller sets them)."""
        self._patch_node_params_at.clear()
        self._reading = None
        return self._patch_node_params()

    def _add_patch_node(self, graph):
        return add_head_node(graph, self._patch_node_params(), "patch")

    def _encode_table(self) -> bool:
        """Write columns and rows, and reset what the patch kernel applied; True if a
        buffer moved. Rows get room to grow, so that new shapes usually append one row."""
        columns, rows, self._row_bytes, column_spans = encode_table(self.table, self.layouts)
        moved = self.buffers["columns"].write(columns)
        moved |= self.buffers["spans"].write(
            encode_spans(self.updatable, column_spans, self._pointer_spans))
        room = max(len(rows), 64 * self._row_bytes)
        if self.buffers["rows"].nbytes < room:
            self.buffers["rows"].close()
            self.buffers["rows"] = DeviceBuffer(2 * room)
            moved = True
        self.buffers["rows"].write_at(0, rows)
        # Row layout may have changed: the next launch applies every column again, every
        # argument address (no address is all ones), and sets every node enabled or
        # disabled (NODES_UNKNOWN). The nodes may be disabled on the device (a failed
        # guard), and whether the upload after a host-side update (``refresh``) keeps the
        # nodes' device-side changes is not documented: a flag kept as it was could say
        # "disabled" over enabled nodes (a failed guard would then run the region), one
        # reset to "enabled" could say so over disabled nodes (a passing guard would run
        # nothing). Unknown is right either way, for one call per node on a launch that
        # patches everything anyway.
        self._reset_patch_state()
        self.buffers["applied"].write(b"\xff" * (8 * max(self.num_args, 1)))
        self._encoded = (list(self.table.columns), len(self.table))
        self._placement = _placement(self.table, self.layouts)
        return moved

    def _reset_patch_state(self) -> None:
        """No row applied, no record applied and the nodes' enabled state unknown: the next
        launch patches every column and enables or disables every node (see
        ``_encode_table``). A synchronous copy: the backend's stream is a blocking one, so
        no launch still in flight can write the state after it (one that did could leave a
        generation the next launch takes as applied, and it would patch nothing)."""
        self.buffers["state"].write(struct.pack("<4I", NO_ROW, NODES_UNKNOWN, NO_GENERATION, 0))

    def refresh(self, rewritten: int | None = None) -> None:
        """The table gained rows (append them), had row ``rewritten`` given to another
        shape (write it), or gained columns (write it all again; nodes that gained their
        first column become device-updatable)."""
        columns, rows = self._encoded
        if columns == self.table.columns and rows == len(self.table) and rewritten is None:
            return
        end = len(self.table) * self._row_bytes
        if columns == self.table.columns and end <= self.buffers["rows"].nbytes:
            first = rows if rewritten is None else min(rows, rewritten)
            new = b"".join(encode_row(self.table.row(r), self._placement, self._row_bytes)
                           for r in range(first, len(self.table)))
            self.buffers["rows"].write_at(first * self._row_bytes, new)
            self._encoded = (columns, len(self.table))
            if rewritten is not None:
                # The patch kernel skips the columns whose value equals the row it applied
                # last; that row's bytes may be the ones just rewritten: apply everything.
                self._reset_patch_state()
            return
        if not self._column_nodes() <= self._device_nodes.keys():
            self._make_updatable(self._column_nodes())  # encodes the table too
            return
        self._encode_table()
        check(driver.cuGraphExecKernelNodeSetParams(
            self.exec, self.patch_node, self._new_patch_node_params()),
            "cuGraphExecKernelNodeSetParams(patch)")
        self.upload(self.stream)  # device-updatable nodes: again after a host-side change

    # -- calls -------------------------------------------------------------------------
    def launch_record(self, row: int, region_args: Sequence[Any], caller: Any = None,
                      moving: Sequence[int] | None = None,
                      guards: Sequence[tuple[Any, Any]] = ()) -> int:
        """Write the launch record for a launch at ``row``; return the bytes to copy to the
        device (0 when it holds them already). A ``caller`` that launched this graph last,
        with the same buffers, names in ``moving`` the only arguments whose address may
        have changed.

        ``guards``: ``(tensor or device address, expect)`` pairs, at most ``MAX_GUARDS``;
        the region's kernels run only if each guard's byte, read on the device when the
        graph runs, is ``expect`` (nonzero counts as 1).
        """
        record = self._launch
        record.set_guards(guards)  # first: guards it refuses leave the record as it was
        if guards and len(self.updatable) < len(self._graph_nodes):
            self._make_updatable(range(len(self._graph_nodes)))  # a failed guard disables all
        same_caller = caller is not None and caller == self._last_caller
        self._last_caller = caller
        nbytes = record.point(row, region_args, moving if same_caller else
                              range(min(len(region_args), self.num_args)))
        if record.moved:  # an argument that nodes not device-updatable hold has moved
            self._make_updatable({node for node, _, arg, _ in self._pointer_map
                                  if arg in record.moved})
            record.moved.clear()
        return nbytes

    def launch(self, nbytes: int, stream) -> None:
        """Queue the copy of the record's first ``nbytes`` (if any) and the graph's launch.
        Each result is compared here and handed to ``check`` only on failure: a call's
        two driver calls pay no Python call more than their own."""
        if self._reading is not None:  # the patch node reads a ready record
            self._read_launch_buffer()
        if nbytes:
            # From pageable memory: the driver stages the bytes before it returns, so the
            # record can be rewritten for the next call at once; the copy itself is ordered
            # before the launch on the stream, whatever runs before it.
            result = driver.cuMemcpyHtoDAsync(self._launch_device, self._launch.address, nbytes,
                                              stream)
            if result[0] != SUCCESS:
                check(result, "cuMemcpyHtoDAsync(launch)")
        result = driver.cuGraphLaunch(self.exec, stream)
        if result[0] != SUCCESS:
            check(result, "cuGraphLaunch")

    def ready_record(self, stream) -> ReadyRecord:
        """The record of the launch just queued on ``stream``, kept in a slot on the device
        for ``launch_ready``."""
        ready = ReadyRecord(self._launch)
        self._place(ready, stream)
        return ready

    def launch_ready(self, ready: ReadyRecord, stream) -> None:
        """Launch as ``ready``'s launch did: the patch node pointed at its slot (one update
        of the instantiated graph from the host) unless it reads it already; its bytes
        copied there again only if its slot went to another record since."""
        if self._reading is not ready:
            if self._slots[ready.slot] is not ready:
                self._place(ready, stream)  # into the slot the node reads, maybe
            if self._reading is not ready:
                self._point_patch_node(self._slot_address(ready.slot))
                self._reading = ready
        result = driver.cuGraphLaunch(self.exec, stream)
        if result[0] != SUCCESS:
            check(result, "cuGraphLaunch")

    def _place(self, ready: ReadyRecord, stream) -> None:
        """Copy ``ready`` into the next slot, after every launch queued before on
        ``stream`` (one of which may read that slot's record)."""
        slot = ready.slot = self._next_slot
        self._next_slot = (slot + 1) % READY_SLOTS
        if self._reading is not None and self._reading is self._slots[slot]:
            self._reading = ready  # the node reads that slot: its new bytes from now on
        self._slots[slot] = ready
        result = driver.cuMemcpyHtoDAsync(self._slot_address(slot), ready.address, ready.nbytes,
                                          stream)
        if result[0] != SUCCESS:
            check(result, "cuMemcpyHtoDAsync(ready launch)")

    def _slot_address(self, slot: int) -> int:
        return self.buffers["ready"].address + slot * self._slot_bytes

    def _read_launch_buffer(self) -> None:
        """Point the patch node back at the launch buffer, which ``launch`` writes."""
        self._point_patch_node(None)
        self._reading = None

    def _point_patch_node(self, launch: int | None) -> None:
        """Have the patch node read its launch record at ``launch`` (the launch buffer if
        None) from the next launch on; launches queued keep what they read (an update of
        the instantiated graph from the host). The other nodes' device-side updates stay:
        such an update overwrites only the node it sets, and the patch node is not
        device-updatable (a GPU test checks the row's updates survive it). Guarded
        launches never come here (``CudaGraphBackend.ready``): whether the nodes a failed
        guard disabled stay so is not documented."""
        check(driver.cuGraphExecKernelNodeSetParams(self.exec, self.patch_node,
                                                    self._patch_node_params(launch)),
              "cuGraphExecKernelNodeSetParams(patch)")

    def replay(self, row: int, region_args: Sequence[Any], stream, caller: Any = None,
               moving: Sequence[int] | None = None,
               guards: Sequence[tuple[Any, Any]] = ()) -> None:
        """Launch at ``row`` (``launch_record``, then ``launch``)."""
        self.launch(self.launch_record(row, region_args, caller, moving, guards), stream)

    def device_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def close(self) -> None:
        super().close()
        self._launch_device = None  # a launch after close fails rather than write freed memory
        for buffer in getattr(self, "buffers", {}).values():
            buffer.close()
