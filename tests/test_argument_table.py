"""Argument tables: grouping by topology, compression, and the patch kernel's encoding.

The records imitate what a CUDA capture of TVM kernels gives: per node a grid, block dims
and parameter bytes (pointers, then int32 shape scalars). ``apply_patch`` is a line-by-line
Python model of ``runtime/kernels/patch.cu``, run on the bytes ``encode_table`` produces.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from grape_tvm.runtime.argument_table import ArgumentTable, NodeRecord, TopologyGroups
from grape_tvm.runtime.topology_graph import NO_ROW, encode_pointers, encode_spans, encode_table

LAYOUT = [(0, 8), (8, 8), (16, 4)]
ALL_ONES = 2 ** 64 - 1  # what TopologyGraph writes as "applied" before the first launch  # two pointers and one int32, as cuFuncGetParamInfo gives


def records(n: int, block: int = 128, kernels=("ln", "mm", "gelu")) -> list[NodeRecord]:
    out = []
    for k, name in enumerate(kernels):
        m = 64 if name.startswith("static") else n  # static kernels (weight layout) ignore n
        grid = ((m + block - 1) // block, 1 if name != "mm" else 12, 1)
        params = (struct.pack("<Q", 0x7F0000000000 + 4096 * k),  # a buffer planned at the bound
                  struct.pack("<Q", 0x7F0000100000 + 4096 * k),
                  struct.pack("<i", m))  # the dynamic length, a scalar argument
        out.append(NodeRecord(name, ((block, 1, 1), 0, (8, 8, 4), ()), (grid,) + params))
    return out


def test_shapes_of_one_topology_share_a_table_with_only_varying_columns():
    table = ArgumentTable(records(1))
    rows = {n: table.add(records(n)) for n in range(2, 301)}
    # Only the grid x of each node and the int32 n vary: 2 columns per node.
    assert len(table.columns) == 2 * 3
    assert all(field in (0, 3) for _, field in table.columns)
    for n in (2, 129, 300):
        assert table.fields(rows[n]) == [r.fields for r in records(n)]
    assert table.fields(0) == [r.fields for r in records(1)]


def test_a_column_that_starts_varying_late_is_back_filled_with_the_base():
    table = ArgumentTable(records(1))
    assert table.add(records(1)) == 1 and table.columns == []
    row = table.add(records(200))
    assert len(table.columns) == 6
    assert table.fields(1) == [r.fields for r in records(1)]  # back-filled
    assert table.fields(row) == [r.fields for r in records(200)]


def test_compression_against_full_tables():
    kernels = ("ln", "mm", "gelu") + tuple(f"static{i}" for i in range(9))
    table = ArgumentTable(records(1, kernels=kernels))
    for n in range(2, 1025):
        table.add(records(n, kernels=kernels))
    full = table.uncompressed_bytes()
    packed = table.compressed_bytes()
    per_shape = (12 + 8 + 8 + 4) * len(kernels)
    assert full == per_shape * 1024
    assert packed == per_shape + (3 * 12 + 3 * 4) * 1024  # grid x3 and n x3 vary
    assert packed < full / 3.5


def test_other_block_dims_or_kernels_make_another_group():
    groups = TopologyGroups()
    assert groups.add((1,), records(1)).new_table is True
    assert groups.add((2,), records(2)) == (0, 1, False, False)
    assert groups.add((3,), records(3, block=256))[:1] == (1,)  # block dims differ
    assert groups.add((4,), records(4, kernels=("ln", "mm")))[:1] == (2,)  # fewer kernels
    assert groups.where[(2,)] == (0, 1)
    with pytest.raises(ValueError, match="another topology"):
        groups.tables[0].add(records(5, block=256))
    described = groups.describe()
    assert [d["shapes"] for d in described] == [2, 1, 1]


def apply_patch(columns: bytes, rows: bytes, row_bytes: int, pointers: bytes, spans: bytes,
                shape_row: int, args: list[int], applied: list[int], state: list[int],
                params: list[bytearray], grids: list[list[int]]) -> int:
    """What patch.cu does, on host memory, node by node as its threads do: ``shape_row``
    and ``args`` are the launch record, ``state[0]`` the row applied last.

    Returns the number of device-side update calls it made.
    """
    updates = 0
    applied_row = state[0]
    new_row = shape_row != applied_row
    row = rows[shape_row * row_bytes:(shape_row + 1) * row_bytes]
    before = None if applied_row == NO_ROW else rows[applied_row * row_bytes:(applied_row + 1) * row_bytes]
    for n in range(len(spans) // 16):
        first_c, count_c, first_p, count_p = struct.unpack_from("<4I", spans, 16 * n)
        for c in range(first_c, first_c + count_c) if new_row else ():
            node, kind, offset, size, at = struct.unpack_from("<5I", columns, 32 * c)
            assert node == n
            width = size if kind == 0 else 12
            value = row[at:at + width]
            if before is not None and before[at:at + width] == value:
                continue
            if kind == 0:
                params[node][offset:offset + size] = value[:size]
            else:
                grids[node] = list(struct.unpack_from("<III", value))
            updates += 1
        for p in range(first_p, first_p + count_p):
            node, offset, arg, _, delta = struct.unpack_from("<IIIIQ", pointers, 24 * p)
            assert node == n
            if args[arg] == applied[arg]:
                continue
            params[node][offset:offset + 8] = struct.pack("<Q", args[arg] + delta)
            updates += 1
    applied[:] = args
    state[0] = shape_row
    return updates


def test_the_patch_kernel_encoding_rebuilds_every_shape_from_the_base():
    table = ArgumentTable(records(1))
    rows = {1: 0}
    for n in np.random.default_rng(0).permutation(np.arange(2, 400))[:120]:
        rows[int(n)] = table.add(records(int(n)))
    columns, packed, row_bytes, column_spans = encode_table(table, [LAYOUT] * 3)
    assert row_bytes == 48 and len(packed) == row_bytes * len(table)  # 3 grids, 3 int32
    # Node 1's second pointer is a region argument (an input): it follows the call's address.
    pointers, pointer_spans = encode_pointers([(1, 1, 0, 64)], [LAYOUT] * 3)
    spans = encode_spans(range(3), column_spans, pointer_spans)
    base = records(1)
    params = [bytearray(b"".join(r.fields[1:])) for r in base]
    grids = [list(r.fields[0]) for r in base]
    state = [NO_ROW, 0, 0, 0]  # what TopologyGraph writes before the first launch
    applied = [ALL_ONES]
    address = None
    steps = list(rows.items())
    # any order: rows overwrite what differs; the input moves every third step, then the
    # last shape comes again at the same address: nothing left to patch.
    calls = [(n, row, 0x5000_0000 + 4096 * (i // 3)) for i, (n, row) in enumerate(steps)]
    calls.append(calls[-1])
    for step, (n, row, address) in enumerate(calls):
        updates = apply_patch(columns, packed, row_bytes, pointers, spans, row, [address],
                              applied, state, params, grids)
        want = records(n)
        for node in range(3):
            expect = bytearray(b"".join(want[node].fields[1:]))
            if node == 1:
                expect[8:16] = struct.pack("<Q", address + 64)
            assert params[node] == expect, (n, node)
            assert tuple(grids[node]) == want[node].fields[0]
        if step == len(calls) - 1:
            assert updates == 0  # same shape, same address: nothing to patch


def test_oversized_varying_parameter_is_refused():
    big = [NodeRecord("k", ((1, 1, 1), 0, (32,), ()), ((1, 1, 1), bytes(32)))]
    table = ArgumentTable(big)
    table.add([NodeRecord("k", ((1, 1, 1), 0, (32,), ()), ((1, 1, 1), bytes([1]) * 32))])
    with pytest.raises(ValueError, match="32-byte kernel parameter varies"):
        encode_table(table, [[(0, 32)]])


def test_eight_byte_values_are_eight_byte_aligned_in_a_row():
    """The device copies an 8-byte parameter with 8-byte accesses: a value at a 4-aligned
    offset faulted on the H200 (cudaErrorMisalignedAddress)."""
    def rec(n):
        return [NodeRecord("k", ((1, 1, 1), 0, (4, 8), ()),
                           ((n, 1, 1), struct.pack("<i", n), struct.pack("<q", n)))]

    table = ArgumentTable(rec(1))
    table.add(rec(7))
    columns, rows, row_bytes, _ = encode_table(table, [[(0, 4), (8, 8)]])
    offsets = {struct.unpack_from("<I", columns, 32 * c + 12)[0]: struct.unpack_from("<I", columns, 32 * c + 16)[0]
               for c in range(len(columns) // 32) if struct.unpack_from("<I", columns, 32 * c + 4)[0] == 0}
    assert offsets[8] % 8 == 0 and offsets[4] % 4 == 0
    assert row_bytes % 8 == 0
    assert struct.unpack_from("<q", rows, row_bytes + offsets[8])[0] == 7


def test_columns_found_late_are_grouped_with_their_node():
    def rec(a, b):  # node 0 varies with a, node 1 with b
        return [NodeRecord("k0", ((1, 1, 1), 0, (4,), ()), ((1, 1, 1), struct.pack("<i", a))),
                NodeRecord("k1", ((1, 1, 1), 0, (4,), ()), ((1, 1, 1), struct.pack("<i", b)))]

    table = ArgumentTable(rec(0, 0))
    table.add(rec(0, 5))  # node 1's column first
    table.add(rec(7, 5))  # then node 0's
    assert table.columns == [(1, 1), (0, 1)]
    columns, rows, row_bytes, spans = encode_table(table, [[(0, 4)], [(0, 4)]])
    assert [struct.unpack_from("<I", columns, 32 * c)[0] for c in range(2)] == [0, 1]
    assert spans == {0: (0, 1), 1: (1, 1)}
    params, grids = [bytearray(4), bytearray(4)], [[1, 1, 1], [1, 1, 1]]
    state = [NO_ROW, 0, 0, 0]
    apply_patch(columns, rows, row_bytes, b"", encode_spans(range(2), spans, {}), 2, [], [], state,
                params, grids)
    assert params == [bytearray(struct.pack("<i", 7)), bytearray(struct.pack("<i", 5))]


def test_pointer_parameters_into_region_arguments_are_topology_not_values():
    """What a capture's kernel parameters become: a pointer into a region argument is part
    of the topology (argument, delta) and zeros in the fields; a scalar stays a value."""
    from types import SimpleNamespace

    import tvm

    from grape_tvm.runtime.cuda_graph import KernelNode, find_pointer_slots, node_records

    arg = tvm.runtime.tensor(np.zeros((4, 4), np.float32))
    params = SimpleNamespace(blockDimX=128, blockDimY=1, blockDimZ=1, sharedMemBytes=0,
                             gridDimX=3, gridDimY=1, gridDimZ=1, func=7)
    node = KernelNode(None, params, [(0, 8), (8, 8)],
                      [(arg.data_ptr() + 16).to_bytes(8, "little"), (5).to_bytes(8, "little")])
    slots = find_pointer_slots([node], [arg])
    assert [(s.node, s.param, s.arg, s.delta) for s in slots] == [(0, 0, 0, 16)]
    (record,) = node_records([node], slots)
    assert record.fixed == ((128, 1, 1), 0, (8, 8), ((0, 0, 16),))
    assert record.fields == ((3, 1, 1), bytes(8), (5).to_bytes(8, "little"))


def test_the_grid_of_a_clustered_node_is_topology_not_a_field():
    """A node launched in thread-block clusters keeps its grid: two shapes whose grids differ
    get graphs of their own (a device-side grid update breaks such a node on the H200),
    while their parameters still vary in one table; a node without clusters shares its
    graph and patches its grid."""
    from types import SimpleNamespace

    from grape_tvm.runtime.argument_table import ArgumentTable, topology_of
    from grape_tvm.runtime.cuda_graph import KernelNode, node_records

    def records(grid_x: int, keys: int, cluster_blocks: int):
        params = SimpleNamespace(blockDimX=128, blockDimY=1, blockDimZ=1, sharedMemBytes=0,
                                 gridDimX=grid_x, gridDimY=12, gridDimZ=1, func=7)
        node = KernelNode(None, params, [(0, 4)], [keys.to_bytes(4, "little")], cluster_blocks)
        return node_records([node], [])

    for cluster_blocks, shared in ((8, False), (1, True)):
        a, b, c = records(8, 257, cluster_blocks), records(16, 257, cluster_blocks), \
            records(8, 300, cluster_blocks)
        assert (topology_of(a) == topology_of(b)) == shared
        table = ArgumentTable(a)
        table.add(c)  # the same grid: one table, the keys a column
        assert table.columns == [(0, 1)]
        if shared:
            table.add(b)
            assert table.columns == [(0, 1), (0, 0)]  # the grid patched per shape


def test_cluster_dims_read_back_are_a_cluster_only_where_they_can_be():
    """``cluster_size``: dims that divide the grid, at least 1 and at most 16 blocks in all,
    are a cluster; the unset attribute's leftovers (as read on the H200) are none."""
    from grape_tvm.runtime.cuda_graph import cluster_size

    assert cluster_size((8, 1, 1), (16, 12, 1)) == 8
    assert cluster_size((2, 2, 1), (4, 6, 3)) == 4
    assert cluster_size((1, 1, 1), (5, 1, 1)) == 1
    assert cluster_size((0, 0, 0), (5, 1, 1)) == 1
    assert cluster_size((100, 0, 843995743), (4096, 1, 1)) == 1
    assert cluster_size((3, 1, 1), (8, 1, 1)) == 1  # not a divisor of the grid
    assert cluster_size((32, 1, 1), (64, 1, 1)) == 1  # more blocks than a cluster holds


def test_a_memset_into_a_region_argument_is_not_kept():
    """A memset's address is fixed in the graph: one into a region argument (which a later
    call may move) makes the graph unfit to keep; one into other memory is fine."""
    import tvm

    from grape_tvm.runtime.cuda_graph import MemsetNode, UnkeptGraph, check_memsets

    arg = tvm.runtime.tensor(np.zeros((4, 4), np.float32))
    inside = MemsetNode(arg.data_ptr() + 60, 0, 4, 1, 1, 0)  # the last float
    check_memsets([MemsetNode(arg.data_ptr() + 64, 0, 4, 4, 1, 0)], [arg])  # just past it
    check_memsets([MemsetNode(arg.data_ptr() - 16, 0, 4, 4, 1, 0)], [arg])  # just before it
    with pytest.raises(UnkeptGraph, match="region argument 0"):
        check_memsets([inside], [arg])
    two_rows = MemsetNode(arg.data_ptr() - 256, 0, 1, 8, 2, 256)  # its second row: arg[0]
    with pytest.raises(UnkeptGraph):
        check_memsets([two_rows], [arg])


def test_the_patch_nodes_parameters_live_until_the_node_is_added(monkeypatch):
    """Regression (H200: ``cuGraphAddKernelNode(patch)`` failed with INVALID_VALUE while
    recording the 256 shapes of the blocks model): the node's ``kernelParams`` points into
    ctypes storage that was a temporary, freed before the driver read it. The driver copies
    the parameters when the node is added; until then the storage must be alive."""
    import weakref  # pylint: disable=import-outside-toplevel
    from types import SimpleNamespace  # pylint: disable=import-outside-toplevel

    from grape_tvm.runtime import topology_graph
    from grape_tvm.runtime.cuda_compile import kernel_params

    made = []
    real = topology_graph.kernel_node_params

    def remembered(function, blocks, threads, shared_bytes, storage):
        made.append(weakref.ref(storage[1]))  # the array kernelParams points to
        return real(function, blocks, threads, shared_bytes, storage)

    def add_head_node(graph, params, what):
        assert made and made[-1]() is not None, f"the {what} node's parameters were freed"
        return "node"

    monkeypatch.setattr(topology_graph, "kernel_node_params", remembered)
    monkeypatch.setattr(topology_graph, "add_head_node", add_head_node)
    graph = SimpleNamespace(_patch_params=lambda launch: kernel_params([("u64", launch)]),
                            updatable=list(range(40)), staged_bytes=0,
                            patch=SimpleNamespace(function=None), _patch_node_params_at={},
                            buffers={"launch": SimpleNamespace(address=1)})
    graph._patch_node_params = topology_graph.TopologyGraph._patch_node_params.__get__(graph)
    assert topology_graph.TopologyGraph._add_patch_node(graph, None) == "node"


class _FakeDriver:
    """The driver calls ``TopologyGraph`` makes, recorded; each succeeds."""

    class CUDA_KERNEL_NODE_PARAMS:  # pylint: disable=invalid-name
        pass

    def __init__(self):
        self.calls: list[str] = []
        self.instantiated = 0

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            if name == "cuGraphInstantiate":
                self.instantiated += 1
                return f"exec{self.instantiated}"
            return 1 if name == "cuMemAlloc" else None
        return call


def _topology_graph(monkeypatch, table, pointer_map, captured):
    """A ``TopologyGraph`` over three nodes on a fake driver, captured with its arguments at
    the addresses ``captured``; which nodes it made device-updatable, and when, is what it
    decided on its own."""
    from types import SimpleNamespace  # pylint: disable=import-outside-toplevel

    from grape_tvm.runtime import cuda_graph, topology_graph
    from grape_tvm.runtime.call_plan import Address  # pylint: disable=import-outside-toplevel

    fake = _FakeDriver()
    made = []
    for module in (topology_graph, cuda_graph):
        monkeypatch.setattr(module, "driver", fake)
        monkeypatch.setattr(module, "check", lambda result, what: result)
    monkeypatch.setattr(topology_graph, "make_device_updatable",
                        lambda node: made.append(node) or 0xD000 + node)
    monkeypatch.setattr(topology_graph, "add_head_node", lambda graph, params, what: "patch")
    nodes = [SimpleNamespace(node=n) for n in range(3)]
    graph = topology_graph.TopologyGraph(
        "graph", nodes, [LAYOUT] * 3, pointer_map, table, 2,
        SimpleNamespace(function="grape_patch"), "stream",
        captured_args=[Address(a) for a in captured])
    return graph, fake, made


def test_only_nodes_the_patch_kernel_updates_are_device_updatable(monkeypatch):
    """A kernel node is device-updatable (about 0.14 us a launch on the H200) only once the
    patch kernel must update it: a column of the table, an argument moved since the capture
    (node 1 holds argument 0, node 2 argument 1), or a guarded launch (all of them). Each
    such change instantiates the graph again; a launch that changes none does not."""
    from grape_tvm.runtime.call_plan import Address  # pylint: disable=import-outside-toplevel

    table = ArgumentTable(records(1))
    graph, fake, made = _topology_graph(monkeypatch, table, [(1, 1, 0, 64), (2, 0, 1, 0)],
                                        captured=[0x1000, 0x2000])
    assert graph.updatable == [] and fake.instantiated == 1
    graph.launch_record(0, [Address(0x1000), Address(0x2000)])  # as captured
    assert graph.updatable == [] and fake.instantiated == 1
    graph.launch_record(0, [Address(0x1000), Address(0x3000)])  # argument 1 moved
    assert graph.updatable == [2] and fake.instantiated == 2
    assert fake.calls.count("cuGraphExecDestroy") == 1
    graph.launch_record(0, [Address(0x1000), Address(0x2000)])  # node 2 follows it now
    assert graph.updatable == [2] and fake.instantiated == 2
    table.add(records(300))  # every node gains columns (grid x, the int32 n)
    graph.refresh()
    assert graph.updatable == [0, 1, 2] and made.count(0) == 1 and fake.instantiated == 3


def test_a_guarded_launch_makes_every_node_device_updatable(monkeypatch):
    from grape_tvm.runtime.call_plan import Address  # pylint: disable=import-outside-toplevel

    graph, fake, _ = _topology_graph(monkeypatch, ArgumentTable(records(1)), [],
                                     captured=[0x1000, 0x2000])
    graph.launch_record(0, [Address(0x1000), Address(0x2000)], guards=[(0x4000, 1)])
    assert graph.updatable == [0, 1, 2] and fake.instantiated == 2
    graph.launch_record(0, [Address(0x1000), Address(0x2000)], guards=[(0x4000, 0)])
    assert fake.instantiated == 2


class _DeviceModel(_FakeDriver):
    """The fake driver with device memory: copies land at their address, the patch node
    reads its launch record where its parameters (host-side, at instantiation or set in
    the instantiated graph) say, and each launch notes the (row, arguments) it read there:
    what the patch kernel would apply."""

    def __init__(self):
        super().__init__()
        self.memory: dict[int, bytes] = {}
        self.next_address = 0x10000
        self.reading = None  # the patch node's launch record address, in the graph exec
        self.node_reads = None  # the same in the graph (instantiation copies it)
        self.read: list[tuple[int, tuple[int, ...]]] = []

    def cuMemAlloc(self, nbytes):  # pylint: disable=invalid-name
        address, self.next_address = self.next_address, self.next_address + nbytes + 0x1000
        return address

    def cuMemcpyHtoD(self, dst, data, nbytes):  # pylint: disable=invalid-name
        self.memory[int(dst)] = bytes(data[:nbytes])

    def cuMemcpyHtoDAsync(self, dst, src, nbytes, stream):  # pylint: disable=invalid-name
        import ctypes  # pylint: disable=import-outside-toplevel

        self.calls.append("cuMemcpyHtoDAsync")
        self.memory[int(dst)] = ctypes.string_at(src, nbytes)
        return (0,)

    @staticmethod
    def launch_address(params) -> int:
        import ctypes  # pylint: disable=import-outside-toplevel

        pointers = ctypes.cast(params.kernelParams, ctypes.POINTER(ctypes.c_void_p))
        return ctypes.c_uint64.from_address(pointers[6]).value  # the patch kernel's `launch`

    def cuGraphKernelNodeSetParams(self, node, params):  # pylint: disable=invalid-name
        self.node_reads = self.launch_address(params)

    def cuGraphInstantiate(self, graph, flags):  # pylint: disable=invalid-name
        self.reading = self.node_reads
        self.instantiated += 1
        return f"exec{self.instantiated}"

    def cuGraphExecKernelNodeSetParams(self, exec_, node, params):  # pylint: disable=invalid-name
        self.calls.append("cuGraphExecKernelNodeSetParams")
        self.reading = self.launch_address(params)

    def cuGraphLaunch(self, exec_, stream):  # pylint: disable=invalid-name
        from grape_tvm.runtime.topology_graph import ARGS_AT  # pylint: disable=import-outside-toplevel

        self.calls.append("cuGraphLaunch")
        record = self.memory[self.reading]
        self.read.append((struct.unpack_from("<I", record, 0)[0],
                          struct.unpack_from("<2Q", record, ARGS_AT)))
        return (0,)


def test_calls_made_again_launch_from_the_records_they_kept(monkeypatch):
    """``TopologyGraph``'s ready records on a model of the device: every launch, written
    by the host (``launch``) or made again (``launch_ready``), reads the row and arguments
    of its own call, through slot reuse (more records than ``READY_SLOTS``), a slot handed
    over while the patch node reads it, and a new instantiation; a record made again as
    the last launch points nothing again and copies nothing."""
    from types import SimpleNamespace  # pylint: disable=import-outside-toplevel

    from grape_tvm.runtime import cuda_graph, topology_graph
    from grape_tvm.runtime.call_plan import Address  # pylint: disable=import-outside-toplevel

    fake = _DeviceModel()
    for module in (topology_graph, cuda_graph):
        monkeypatch.setattr(module, "driver", fake)
        monkeypatch.setattr(module, "check", lambda result, what: result)
    monkeypatch.setattr(topology_graph, "SUCCESS", 0)
    monkeypatch.setattr(topology_graph, "make_device_updatable", lambda node: 0xD000 + node)

    def add_head_node(graph, params, what):
        fake.node_reads = fake.launch_address(params)
        return "patch"

    monkeypatch.setattr(topology_graph, "add_head_node", add_head_node)
    table = ArgumentTable(records(1))  # (rows are the record's: the model applies none)
    graph = topology_graph.TopologyGraph(
        "graph", [SimpleNamespace(node=n) for n in range(3)], [LAYOUT] * 3,
        [(1, 1, 0, 64), (2, 0, 1, 0)], table, 2, SimpleNamespace(function="grape_patch"),
        "stream", captured_args=[Address(0x1000), Address(0x2000)])

    def call(row: int, first: int):
        """A call written by the host, then kept: the (row, arguments) it launches."""
        args = (first, 0x2000)
        graph.launch(graph.launch_record(row, [Address(a) for a in args]), "stream")
        return (row, args), graph.ready_record("stream")

    slots = topology_graph.READY_SLOTS
    kept = [call(i % 2, 0x1000 + 0x100 * i) for i in range(slots + 3)]  # slots 0-2 reused
    expected = [want for want, _ in kept]

    def again(i: int) -> list[str]:
        """Make call ``i`` again: the driver calls it took."""
        count = len(fake.calls)
        graph.launch_ready(kept[i][1], "stream")
        expected.append(kept[i][0])
        return fake.calls[count:]

    point, copy, launch = "cuGraphExecKernelNodeSetParams", "cuMemcpyHtoDAsync", "cuGraphLaunch"
    assert again(5) == [point, launch] and again(5) == [launch]
    assert again(slots + 1) == [point, launch]
    assert again(0) == [copy, point, launch]  # its slot went to call 16: copied to slot 3
    assert again(3) == [copy, point, launch]  # and so on: to slot 4
    assert again(4) == [copy, point, launch]  # to slot 5, call 5's
    assert again(5) == [copy, point, launch]  # to slot 6
    assert again(7) == [point, launch]  # still in slot 7, the next to go
    assert again(6) == [copy, launch]  # to slot 7, which the patch node reads: not pointed
    assert again(7) == [copy, point, launch]  # to slot 8
    want, _ = call(1, 0x9000)  # written by the host in between: the launch buffer again
    expected.append(want)
    assert again(7) == [point, launch]
    graph._make_updatable({2})  # pylint: disable=protected-access  # instantiated again
    assert again(7) == [point, launch] and again(0) == [point, launch]
    assert fake.read == expected
