"""One CUDA graph per topology, patched from the device by the patch kernel.

``TopologyGraph`` owns, for one group of shapes that launch the same kernels with the same
block dims: the graph captured at the group's first shape, its instantiation, and the device
buffers of its argument table. Its kernel nodes are device-updatable; a ``PatchKernel`` node
at the head applies the current shape's row (grid dims, scalar parameters) and the current
call's argument addresses. A call writes the row index and any argument address that moved
(``cuStreamWriteValue32/64``, stream-ordered) and launches: no capture, no instantiation, no
host-side node update.
"""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path
from typing import Any, Sequence

from .argument_table import ArgumentTable
from .cuda_compile import CubinStore
from .cuda_driver import check, driver

SLOT_BYTES = 16  # bytes per column value in a row
PATCH_SOURCE = Path(__file__).with_name("kernels") / "patch.cu"


class PatchKernel:
    """The compiled patch kernel, loaded once per backend (owns its CUmodule).

    Its cubin comes from the artifact (built with the model's kernels), else from the
    cache or nvcc (``CubinStore``).
    """

    def __init__(self, store: CubinStore):
        cubin = store.lookup(PATCH_SOURCE.read_text())
        self.module = check(driver.cuModuleLoadData(cubin), "cuModuleLoadData(patch kernel)")
        self.function = check(driver.cuModuleGetFunction(self.module, b"grape_patch"),
                              "cuModuleGetFunction(grape_patch)")

    def close(self) -> None:
        if self.module is not None:
            driver.cuModuleUnload(self.module)
            self.module = None


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

    @property
    def address(self) -> int:
        return int(self.ptr)

    def close(self) -> None:
        if self.ptr is not None:
            driver.cuMemFree(self.ptr)
            self.ptr = None


def encode_table(table: ArgumentTable, layouts: Sequence[Sequence[tuple[int, int]]]) -> tuple[bytes, bytes]:
    """The patch kernel's ``columns`` and ``rows`` (layout in kernels/patch.cu).

    Field 0 of a node is its grid (kind 1); field i > 0 is kernel parameter i - 1 (kind 0),
    patched at its offset in the parameter buffer (``cuFuncGetParamInfo``).
    """
    columns, fields = [], []
    for node, field in table.columns:
        if field == 0:
            columns.append(struct.pack("<IIII", node, 1, 0, 12))
        else:
            offset, size = layouts[node][field - 1]
            if size > SLOT_BYTES:
                raise ValueError(f"a {size}-byte kernel parameter varies across shapes; the "
                                 f"patch kernel patches up to {SLOT_BYTES} bytes")
            columns.append(struct.pack("<IIII", node, 0, offset, size))
        fields.append(field)
    rows = bytearray()
    for r in range(len(table)):
        for field, value in zip(fields, table.row(r)):
            raw = struct.pack("<III", *value) if field == 0 else bytes(value)
            rows += raw.ljust(SLOT_BYTES, b"\0")
    return b"".join(columns), bytes(rows)


def encode_pointers(pointer_map: Sequence[tuple[int, int, int, int]],
                    layouts: Sequence[Sequence[tuple[int, int]]]) -> bytes:
    """The patch kernel's ``pointers``: (node, param offset, region argument, delta)."""
    return b"".join(struct.pack("<IIIIQ", node, layouts[node][param][0], arg, 0, delta)
                    for node, param, arg, delta in pointer_map)


def _device_updatable(node) -> int:
    """Opt a kernel node into device-side updates; return its device handle."""
    attr = driver.CUkernelNodeAttrID.CU_LAUNCH_ATTRIBUTE_DEVICE_UPDATABLE_KERNEL_NODE
    value = driver.CUkernelNodeAttrValue()
    value.deviceUpdatableKernelNode.deviceUpdatable = 1
    check(driver.cuGraphKernelNodeSetAttribute(node, attr, value),
          "cuGraphKernelNodeSetAttribute(device updatable)")
    got = check(driver.cuGraphKernelNodeGetAttribute(node, attr), "cuGraphKernelNodeGetAttribute")
    return int(got.deviceUpdatableKernelNode.devNode)


def _kernel_params(values: Sequence[tuple[str, int]]):
    """ctypes storage for a kernel's parameters; keep the result alive until the call."""
    boxes = [ctypes.c_uint64(v) if kind == "u64" else ctypes.c_uint32(v) for kind, v in values]
    array = (ctypes.c_void_p * len(boxes))(*[ctypes.addressof(b) for b in boxes])
    return boxes, array


class TopologyGraph:
    """The one graph of a topology group, with its argument table on the device."""

    def __init__(self, graph, nodes, layouts: list[list[tuple[int, int]]],
                 pointer_map: list[tuple[int, int, int, int]], table: ArgumentTable,
                 num_args: int, patch: PatchKernel, stream):
        self.graph = graph
        self.table = table
        self.layouts = layouts
        self.stream = stream
        self.patch = patch
        self.num_args = num_args
        self._written_row: int | None = None
        self._written_args: list[int | None] = [None] * num_args
        self.dev_nodes = [_device_updatable(n.node) for n in nodes]
        self.buffers = {name: DeviceBuffer(16) for name in
                        ("columns", "rows", "pointers", "args", "shape_row", "nodes")}
        self.buffers["nodes"].write(struct.pack(f"<{len(self.dev_nodes)}Q", *self.dev_nodes))
        self.buffers["args"].write(bytes(8 * max(num_args, 1)))
        self.buffers["pointers"].write(encode_pointers(pointer_map, layouts))
        self.num_pointers = len(pointer_map)
        self._encode_table()
        self.patch_node = self._add_patch_node(graph)
        self.exec = check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        self._upload()

    # -- building ----------------------------------------------------------------------
    def _patch_params(self):
        b = self.buffers
        return _kernel_params([
            ("u64", b["columns"].address), ("u32", len(self.table.columns)),
            ("u64", b["rows"].address), ("u64", b["pointers"].address),
            ("u32", self.num_pointers), ("u64", b["args"].address),
            ("u64", b["shape_row"].address), ("u64", b["nodes"].address)])

    def _patch_node_params(self, storage):
        params = driver.CUDA_KERNEL_NODE_PARAMS()
        params.func = self.patch.function
        params.gridDimX = params.gridDimY = params.gridDimZ = 1
        params.blockDimX = params.blockDimY = params.blockDimZ = 1
        params.sharedMemBytes = 0
        params.kernelParams = ctypes.addressof(storage[1])
        return params

    def _add_patch_node(self, graph):
        roots, count = check(driver.cuGraphGetRootNodes(graph, 0), "cuGraphGetRootNodes")
        roots, count = check(driver.cuGraphGetRootNodes(graph, count), "cuGraphGetRootNodes")
        storage = self._patch_params()
        node = check(driver.cuGraphAddKernelNode(graph, None, 0, self._patch_node_params(storage)),
                     "cuGraphAddKernelNode(patch)")
        roots = list(roots[:count])
        check(driver.cuGraphAddDependencies(graph, [node] * len(roots), roots, None, len(roots)),
              "cuGraphAddDependencies")
        return node

    def _encode_table(self) -> bool:
        """Write columns and rows to the device; True if a buffer moved."""
        columns, rows = encode_table(self.table, self.layouts)
        moved = self.buffers["columns"].write(columns)
        moved |= self.buffers["rows"].write(rows)
        self._encoded = (len(self.table.columns), len(self.table))
        return moved

    def _upload(self) -> None:
        # Device-updatable nodes updated from inside the graph: upload before launching,
        # and again after any host-side change (CUDA docs; stale parameters seen otherwise).
        check(driver.cuGraphUpload(self.exec, self.stream), "cuGraphUpload")

    def refresh(self) -> None:
        """The table gained rows or columns: write it again (and re-point the patch node)."""
        if self._encoded == (len(self.table.columns), len(self.table)):
            return
        if self._encode_table():
            storage = self._patch_params()
            check(driver.cuGraphExecKernelNodeSetParams(
                self.exec, self.patch_node, self._patch_node_params(storage)),
                "cuGraphExecKernelNodeSetParams(patch)")
            self._upload()

    # -- calls -------------------------------------------------------------------------
    def replay(self, row: int, region_args: Sequence[Any], stream) -> None:
        for i, arg in enumerate(region_args[:self.num_args]):
            address = arg.data_ptr() if hasattr(arg, "data_ptr") else 0
            if address != self._written_args[i]:
                check(driver.cuStreamWriteValue64(stream, self.buffers["args"].address + 8 * i,
                                                  address, 0), "cuStreamWriteValue64")
                self._written_args[i] = address
        if row != self._written_row:
            check(driver.cuStreamWriteValue32(stream, self.buffers["shape_row"].address, row, 0),
                  "cuStreamWriteValue32")
            self._written_row = row
        check(driver.cuGraphLaunch(self.exec, stream), "cuGraphLaunch")

    def device_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def close(self) -> None:
        if getattr(self, "exec", None) is not None:
            driver.cuGraphExecDestroy(self.exec)
            self.exec = None
        if getattr(self, "graph", None) is not None:
            driver.cuGraphDestroy(self.graph)
            self.graph = None
        for buffer in getattr(self, "buffers", {}).values():
            buffer.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # pylint: disable=broad-except
            pass
