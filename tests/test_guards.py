"""Guards (predication) of region graphs, without a GPU.

The launch record's bytes are checked against the layout patch.cu reads; ``run_patch`` is a
Python model of the kernel's guard handling around ``apply_patch`` (test_argument_table's
model of the patching), run on those bytes.
"""

from __future__ import annotations

import struct
from types import SimpleNamespace

import numpy as np
import pytest
from test_argument_table import LAYOUT, apply_patch, records

from grape_tvm.runtime.argument_table import ArgumentTable
from grape_tvm.runtime.cuda_compile import compile_cubin, nvcc_available
from grape_tvm.runtime.topology_graph import (MAX_GUARDS, NO_ROW, NODES_UNKNOWN, PATCH_SOURCE,
                                              LaunchRecord, encode_pointers, encode_spans,
                                              encode_table, pack_launch_record)

ENABLED, DISABLED = 0, 1  # GRAPE_NODES_ENABLED / _DISABLED in patch.cu


def tensor(address: int):
    return SimpleNamespace(data_ptr=lambda: address)


def test_launch_record_layout():
    record = pack_launch_record(7, [0x1000, 0x2000], [(0xA0, 1), (tensor(0xB0), 0)])
    assert len(record) == 8 + 2 * 8 + 2 * 16
    assert struct.unpack("<II2Q4Q", record) == (7, 2, 0x1000, 0x2000, 0xA0, 1, 0xB0, 0)
    # No guards: the record is what it was before guards, with num_guards 0.
    assert pack_launch_record(3, [0x1000]) == struct.pack("<IIQ", 3, 0, 0x1000)


def test_a_region_without_arguments_keeps_one_argument_slot():
    """patch.cu finds the guards after max(num_args, 1) slots, as the host reserves them."""
    record = pack_launch_record(1, [], [(0xA0, 1)], num_args=0)
    assert struct.unpack("<IIQQQ", record) == (1, 1, 0, 0xA0, 1)


def test_expect_is_normalized_to_zero_or_one():
    guards = [(0x10, 2), (0x20, True), (0x30, np.bool_(False)), (0x40, 0), (0x50, np.int8(-1))]
    record = pack_launch_record(0, [0x1], guards)
    expects = [struct.unpack_from("<Q", record, 16 + 16 * g + 8)[0] for g in range(5)]
    assert expects == [1, 1, 0, 0, 1]


def test_guards_beyond_the_nesting_limit_are_refused():
    guards = [(0x10 * (g + 1), 1) for g in range(MAX_GUARDS)]
    assert len(pack_launch_record(0, [0x1], guards)) == 16 + 16 * MAX_GUARDS
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
    record.set_arg(0, 0x1000)
    assert record.pending() is not None
    assert record.pending() is None  # nothing changed since
    record.set_guards([(0xA0, 1)])
    assert record.pending() is not None  # a guard came
    record.set_guards([(tensor(0xA0), True)])
    assert record.pending() is None  # the same guard, spelled otherwise
    record.set_guards([(0xA0, 0)])
    assert struct.unpack_from("<Q", record.pending(), 24)[0] == 0  # expect changed
    record.set_guards([])
    assert record.pending() == struct.pack("<IIQ", 0, 0, 0x1000)  # guards dropped
    assert record.pending() is None


def run_patch(launch: bytes, num_args: int, memory: dict[int, int], enabled: list[bool],
              state: list[int], *table, applied: list[int], params, grids) -> bool:
    """What patch.cu does with the guards of ``launch`` (bytes as the host sends them):
    thread 0 reads them, then the nodes are enabled or disabled if that changes them, and
    only a launch whose guards hold patches. Returns whether the region runs."""
    shape_row, num_guards = struct.unpack_from("<II", launch)
    args = list(struct.unpack_from(f"<{num_args}Q", launch, 8))
    guards_at = 8 + 8 * max(num_args, 1)
    run = all((memory[address] != 0) == (expect != 0) for address, expect in
              (struct.unpack_from("<QQ", launch, guards_at + 16 * g) for g in range(num_guards)))
    nodes_now = ENABLED if run else DISABLED
    if state[1] != nodes_now:
        enabled[:] = [run] * len(enabled)
    state[1] = nodes_now
    if run:
        apply_patch(*table, shape_row, args, applied, state, params, grids)
    return run


def test_a_failed_guard_disables_the_nodes_and_patches_nothing():
    table = ArgumentTable(records(1))
    rows = {n: table.add(records(n)) for n in (100, 300)}
    columns, packed, row_bytes, column_spans = encode_table(table, [LAYOUT] * 3)
    pointers, pointer_spans = encode_pointers([(1, 1, 0, 64)], [LAYOUT] * 3)
    encoded = (columns, packed, row_bytes, pointers, encode_spans(3, column_spans, pointer_spans))
    base = records(1)
    params = [bytearray(b"".join(r.fields[1:])) for r in base]
    grids = [list(r.fields[0]) for r in base]
    state, applied, enabled = [NO_ROW, NODES_UNKNOWN, 0, 0], [2 ** 64 - 1], [True] * 3
    cond = 0xC0
    memory = {cond: 1}

    def launch(n, address, expect):
        record = pack_launch_record(rows[n], [address], [(cond, expect)])
        return run_patch(record, 1, memory, enabled, state, *encoded, applied=applied,
                         params=params, grids=grids)

    def holds(n, address):
        want = records(n)
        for node in range(3):
            expect = bytearray(b"".join(want[node].fields[1:]))
            if node == 1:
                expect[8:16] = struct.pack("<Q", address + 64)
            assert params[node] == expect and tuple(grids[node]) == want[node].fields[0]

    assert launch(100, 0x5000, 1) and enabled == [True] * 3
    holds(100, 0x5000)
    patched = [bytearray(p) for p in params]
    assert not launch(300, 0x6000, 0)  # the other branch: skipped, nothing patched
    assert enabled == [False] * 3 and params == patched
    assert state[:2] == [rows[100], DISABLED] and applied == [0x5000]
    memory[cond] = 0  # the condition flips: this branch runs, patched relative to n=100
    assert launch(300, 0x6000, 0) and enabled == [True] * 3
    holds(300, 0x6000)

    # A re-encode while the nodes are disabled: the host cannot know what the device holds
    # (TopologyGraph._encode_table), so the next launch sets every node either way.
    assert not launch(300, 0x6000, 1) and enabled == [False] * 3
    state[:] = [NO_ROW, NODES_UNKNOWN, 0, 0]
    applied[:] = [2 ** 64 - 1]
    enabled[:] = [True] * 3  # had the upload enabled them, a failed guard still disables
    assert not launch(300, 0x6000, 1) and enabled == [False] * 3
    state[1] = NODES_UNKNOWN
    assert launch(100, 0x5000, 0) and enabled == [True] * 3  # and a passing one enables
    holds(100, 0x5000)


@pytest.mark.skipif(not nvcc_available(), reason="nvcc is not on PATH")
def test_the_patch_kernel_compiles():
    """As the compiler builds it for an artifact (compile_cubin: nvcc --cubin -O3)."""
    assert len(compile_cubin(PATCH_SOURCE.read_text(), "sm_90")) > 0


def test_launch_buffer_and_plans_agree_on_the_guard_limit():
    """A plan never gives a region more guards than the launch record holds, and the
    record's capacity (what the device buffer is allocated with) holds them all."""
    from grape_tvm.runtime import call_plan, topology_graph  # pylint: disable=import-outside-toplevel

    assert call_plan.MAX_GUARDS == topology_graph.MAX_GUARDS
    for num_args in (0, 1, 5):
        record = topology_graph.LaunchRecord(num_args)
        record.set_guards([(64 * (g + 1), g % 2) for g in range(topology_graph.MAX_GUARDS)])
        assert len(record.used()) == record.capacity
