"""Guards (predication) of region graphs, without a GPU: the launch record's bytes against
the layout patch.cu reads, and the patch kernel compiles. What the kernel does with them is
tested on the GPU only (tests/test_gpu.py)."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import numpy as np
import pytest

from grape_tvm.runtime.call_program import MAX_GUARDS
from grape_tvm.runtime.cuda_compile import compile_cubin, nvcc_available
from grape_tvm.runtime.call_plan import Address
from grape_tvm.runtime.topology_graph import (NO_GENERATION, NO_ROW, NODES_UNKNOWN, PATCH_SOURCE,
                                             LaunchRecord, TopologyGraph)


def tensor(address: int):
    return SimpleNamespace(data_ptr=lambda: address)


def pack_launch_record(row: int, addresses, guards=(), num_args: int | None = None) -> bytes:
    """One call's launch record, as ``TopologyGraph.replay`` fills it."""
    record = LaunchRecord(len(addresses) if num_args is None else num_args)
    record.set_guards(guards)
    record.point(row, [Address(a) for a in addresses], range(len(addresses)))
    return record.used()


def test_launch_record_layout():
    record = pack_launch_record(7, [0x1000, 0x2000], [(0xA0, 1), (tensor(0xB0), 0)])
    assert len(record) == 16 + 2 * 8 + 2 * 16
    # row, guards, generation (the record's first change: 1), pad, args, guards
    assert struct.unpack("<IIII2Q4Q", record) == (7, 2, 1, 0, 0x1000, 0x2000, 0xA0, 1, 0xB0, 0)
    # No guards: the header and the arguments, with num_guards 0.
    assert pack_launch_record(3, [0x1000]) == struct.pack("<IIIIQ", 3, 0, 1, 0, 0x1000)


def test_a_region_without_arguments_keeps_one_argument_slot():
    """patch.cu finds the guards after max(num_args, 1) slots, as the host reserves them."""
    record = pack_launch_record(1, [], [(0xA0, 1)], num_args=0)
    assert struct.unpack("<II8xQQQ", record) == (1, 1, 0, 0xA0, 1)


def test_expect_is_normalized_to_zero_or_one():
    guards = [(0x10, 2), (0x20, True), (0x30, np.bool_(False)), (0x40, 0), (0x50, np.int8(-1))]
    record = pack_launch_record(0, [0x1], guards)
    expects = [struct.unpack_from("<Q", record, 24 + 16 * g + 8)[0] for g in range(5)]
    assert expects == [1, 1, 0, 0, 1]


def test_guards_beyond_the_nesting_limit_are_refused():
    guards = [(0x10 * (g + 1), 1) for g in range(MAX_GUARDS)]
    assert len(pack_launch_record(0, [0x1], guards)) == 24 + 16 * MAX_GUARDS
    with pytest.raises(ValueError, match=f"nests in at most {MAX_GUARDS} data-dependent ifs"):
        pack_launch_record(0, [0x1], guards + [(0x1000, 0)])


def test_a_refused_guard_leaves_the_record_as_it_was():
    record = LaunchRecord(1)
    record.set_guards([(0xA0, 1)])
    before = record.used()
    for bad in ([(0xB0, 1), (0, 1)], [(None, 1)], [(0xB0, 1)] * (MAX_GUARDS + 1)):
        with pytest.raises(ValueError):
            record.set_guards(bad)
        assert record.used() == before


def test_a_copy_is_queued_only_when_the_record_changed():
    record = LaunchRecord(1)
    assert record.pending() is not None  # the first one: written at construction
    assert record.point(0, [Address(0x1000)], [0]) > 0
    assert record.pending() is None  # taken by point
    assert record.pending() is None  # nothing changed since
    record.set_guards([(0xA0, 1)])
    assert record.pending() is not None  # a guard came
    record.set_guards([(tensor(0xA0), True)])
    assert record.pending() is None  # the same guard, spelled otherwise
    record.set_guards([(0xA0, 0)])
    assert struct.unpack_from("<Q", record.pending(), 32)[0] == 0  # expect changed
    record.set_guards([])
    assert record.pending() == struct.pack("<IIIIQ", 0, 0, 5, 0, 0x1000)  # guards dropped
    assert record.pending() is None


def test_each_changed_record_taken_gets_the_next_generation():
    """patch.cu returns at once when the record's generation is the one it applied last: a
    record that changed must never keep the generation of the one before."""
    record = LaunchRecord(2)
    generations = [struct.unpack_from("<I", record.pending(), 8)[0]]
    for row, address in ((0, 0x1000), (1, 0x1000), (1, 0x2000)):
        assert record.point(row, [Address(address), Address(0x3000)], [0, 1]) > 0
        generations.append(struct.unpack_from("<I", record.used(), 8)[0])
        assert record.point(row, [Address(address), Address(0x3000)], [0, 1]) == 0
        assert struct.unpack_from("<I", record.used(), 8)[0] == generations[-1]
    record.set_guards([(0xA0, 1)])
    generations.append(struct.unpack_from("<I", record.pending(), 8)[0])
    assert generations == [1, 2, 3, 4, 5] and record.generation == 5
    record.generation = 0xFFFFFFFF  # wraps past the all-ones value to 1, never to 0
    record.set_guards([])
    assert struct.unpack_from("<I", record.pending(), 8)[0] == 1


@pytest.mark.skipif(not nvcc_available(), reason="nvcc is not on PATH")
def test_the_patch_kernel_compiles():
    """As the compiler builds it for an artifact (compile_cubin: nvcc --cubin -O3)."""
    assert len(compile_cubin(PATCH_SOURCE.read_text(), "sm_90")) > 0


def test_the_launch_buffer_holds_as_many_guards_as_a_plan_gives():
    """The record's capacity (what the device buffer is allocated with) holds the most
    guards a plan gives a region (``call_program.MAX_GUARDS``)."""
    for num_args in (0, 1, 5):
        record = LaunchRecord(num_args)
        record.set_guards([(64 * (g + 1), g % 2) for g in range(MAX_GUARDS)])
        assert len(record.used()) == record.capacity


def test_the_patch_kernel_stages_what_fits_in_shared_memory():
    """args and applied (16 bytes an argument), then the pointers (one ``encode_pointers``
    entry each), as far as ``STAGED_BYTES`` allows; a region too large stages nothing."""
    from grape_tvm.runtime.topology_graph import (  # pylint: disable=import-outside-toplevel
        POINTER_BYTES, STAGE_ARGS, STAGE_POINTERS, STAGED_BYTES, encode_pointers, patch_staging)

    data, _ = encode_pointers([(0, 0, 1, 8), (1, 0, 0, 0)], [[(0, 8)], [(0, 8)]])
    assert len(data) == 2 * POINTER_BYTES
    assert patch_staging(300, 1000) == (STAGE_POINTERS, 16 * 300 + POINTER_BYTES * 1000)
    many = STAGED_BYTES // POINTER_BYTES
    assert patch_staging(300, many) == (STAGE_ARGS, 16 * 300)
    assert patch_staging(STAGED_BYTES // 16 + 1, 0) == (0, 0)


class _KeptBuffer:
    """A ``DeviceBuffer``'s writes, kept (no device)."""

    def __init__(self):
        self.nbytes = 1 << 16
        self.writes: list = []

    def write(self, data: bytes) -> bool:
        self.writes.append(bytes(data))
        return False

    def write_at(self, offset: int, data: bytes) -> None:
        self.writes.append((offset, bytes(data)))


class _Table:
    """An argument table of one grid column (node 0), a row per shape."""

    columns = [(0, 0)]

    def __init__(self, grids):
        self.grids = grids

    def __len__(self):
        return len(self.grids)

    def row(self, row: int):
        return [self.grids[row]]


@pytest.mark.parametrize("rewritten,reset", [(None, False), (0, True)])
def test_a_rewritten_row_makes_the_next_launch_patch_it_again(rewritten, reset):
    """``TopologyGraph.refresh``: a row given to another shape is written, and, since the
    patch kernel compares with the row it applied last (whose bytes just changed), the
    state says nothing is applied, its generation too: the next launch's record may be the
    one applied last (same row, same addresses), and patch.cu returns early on an applied
    generation. Rows only appended leave the state as it was."""
    graph = object.__new__(TopologyGraph)
    graph.table = _Table([(1, 1, 1), (2, 1, 1)])
    graph._row_bytes, graph._placement = 12, [(0, 0)]  # pylint: disable=protected-access
    graph._encoded = (list(_Table.columns), 1)  # pylint: disable=protected-access
    graph.buffers = {"rows": _KeptBuffer(), "state": _KeptBuffer()}
    if rewritten is not None:
        graph.table.grids[rewritten] = (3, 1, 1)
    graph.refresh(rewritten)
    rows, state = graph.buffers["rows"].writes, graph.buffers["state"].writes
    first = 0 if rewritten is not None else 1
    assert rows == [(12 * first, b"".join(struct.pack("<III", *g) for g in graph.table.grids[first:]))]
    assert state == ([struct.pack("<4I", NO_ROW, NODES_UNKNOWN, NO_GENERATION, 0)] if reset else [])
