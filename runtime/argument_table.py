"""Per-shape argument tables, grouped by topology and compressed against a base.

A region recorded at one shape is a list of ``NodeRecord``: which kernel, what must not
change for a graph to be reused (block dims, shared memory, parameter sizes) and the fields
a patch may change (grid dims, each parameter's bytes). Shapes whose records agree on
everything but the fields share a topology, hence one graph. Their ``ArgumentTable`` keeps
one base and, per shape, only the columns that vary anywhere in the group: a row of a few
values where a full table (or another instantiated graph) would repeat everything.

    table = ArgumentTable(records_at_n1)      # base, row 0
    row = table.add(records_at_n300)          # row 1: values of the varying columns only
    table.columns                              # [(node, field), ...] that differ somewhere
    table.fields(row)                          # the full fields of n=300, rebuilt

Pure Python: used by the CUDA backend (bytes of kernel parameters) and the CPU replay
(Python values of kernel arguments) alike.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, NamedTuple, Sequence


@dataclass(frozen=True)
class NodeRecord:
    """One node of a recorded region: a kernel launch."""

    kernel: Hashable  # the kernel's identity (CUfunction handle, or PrimFunc name)
    fixed: tuple  # must match for two shapes to share a graph
    fields: tuple  # what a patch may change per shape


Topology = tuple  # tuple of (kernel, fixed) per node, in launch order


def topology_of(records: Sequence[NodeRecord]) -> Topology:
    return tuple((r.kernel, r.fixed) for r in records)


def field_size(value: Any) -> int:
    """Bytes a field takes in an uncompressed table: raw bytes as they are, a tuple of
    ints as dims (4 bytes each, like a grid's uint3), any other scalar 8 bytes."""
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, tuple):
        return 4 * len(value)
    return 8


class ArgumentTable:
    """The argument table of one topology: a base and the varying columns of every shape."""

    def __init__(self, base: Sequence[NodeRecord]):
        self.topology = topology_of(base)
        self.base: list[tuple] = [r.fields for r in base]
        self.columns: list[tuple[int, int]] = []  # (node, field index)
        self._rows: list[list[Any]] = [[]]  # row 0 is the base itself
        self._free: list[int] = []  # rows of shapes given up, reused before new ones

    def __len__(self) -> int:
        """Rows held, in use or free: a row's index never changes while it is in use."""
        return len(self._rows)

    def matches(self, records: Sequence[NodeRecord]) -> bool:
        return topology_of(records) == self.topology

    def add(self, records: Sequence[NodeRecord]) -> int:
        """Add one shape's records; return its row (a free one if there is one, else a new
        one at the end). Columns grow as new fields vary."""
        if not self.matches(records):
            raise ValueError("records of another topology: they need a graph of their own")
        for node, record in enumerate(records):
            for i, value in enumerate(record.fields):
                if value != self.base[node][i] and (node, i) not in self._column_index:
                    self._add_column(node, i)
        values = [records[n].fields[i] for n, i in self.columns]
        if self._free:
            row = self._free.pop()
            self._rows[row] = values
            return row
        self._rows.append(values)
        return len(self._rows) - 1

    def release(self, row: int) -> None:
        """The shape at ``row`` is given up: a later ``add`` may write another shape there."""
        self._free.append(row)

    @property
    def _column_index(self) -> dict[tuple[int, int], int]:
        return {c: k for k, c in enumerate(self.columns)}

    def _add_column(self, node: int, index: int) -> None:
        # Rows recorded before this column existed had the base value in it.
        self.columns.append((node, index))
        base = self.base[node][index]
        for row in self._rows:
            row.append(base)

    def row(self, row: int) -> list[Any]:
        """Values of the varying columns at ``row``, in column order."""
        return list(self._rows[row])

    def fields(self, row: int) -> list[tuple]:
        """The full fields of every node at ``row``: base patched with the row."""
        nodes = [list(f) for f in self.base]
        for (node, i), value in zip(self.columns, self._rows[row]):
            nodes[node][i] = value
        return [tuple(f) for f in nodes]

    # -- sizes -------------------------------------------------------------------------
    def uncompressed_bytes(self) -> int:
        """One full table per shape: what per-shape graphs would each hold."""
        per_shape = sum(field_size(v) for fields in self.base for v in fields)
        return per_shape * len(self._rows)

    def compressed_bytes(self) -> int:
        """The base once, plus each shape's row of varying columns (4-byte aligned)."""
        base = sum(field_size(v) for fields in self.base for v in fields)
        row = sum((field_size(self.base[n][i]) + 3) // 4 * 4 for n, i in self.columns)
        return base + row * len(self._rows)


class Placement(NamedTuple):
    """Where ``TopologyGroups.add`` put a shape."""

    table: int
    row: int
    new_table: bool  # the first shape of a new topology: it needs a graph of its own
    reused_row: bool  # the row held a shape given up before: a copy of it must be rewritten


class TopologyGroups:
    """Shapes grouped by topology: one ``ArgumentTable`` (and one graph) per group.

    At most ``max_shapes`` shapes are held: adding one more gives up the least recently used
    (``lookup`` counts as a use), whose row the next shape of its table reuses. A table and
    its graph stay once made; only rows come and go.
    """

    def __init__(self, max_shapes: int | None = None):
        if max_shapes is not None and max_shapes < 1:
            raise ValueError(f"max_shapes must be at least 1, got {max_shapes}")
        self.max_shapes = max_shapes
        self.tables: list[ArgumentTable] = []
        self.where: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()  # shape -> (table, row)
        self.evicted = 0

    def lookup(self, shape: Hashable) -> tuple[int, int] | None:
        """``(table, row)`` of a shape held, marked as the most recently used; else None."""
        found = self.where.get(shape)
        if found is not None:
            self.where.move_to_end(shape)
        return found

    def touch(self, shape: Hashable) -> None:
        """Mark a shape held as the most recently used (what ``lookup`` does on a hit)."""
        self.where.move_to_end(shape)

    def add(self, shape: Hashable, records: Sequence[NodeRecord]) -> Placement:
        """Place a shape's records: in the table of its topology, or in a new one."""
        topology = topology_of(records)
        index = next((t for t, table in enumerate(self.tables) if table.topology == topology),
                     None)
        if index is None:
            self.tables.append(ArgumentTable(records))
            placement = Placement(len(self.tables) - 1, 0, True, False)
        else:
            table = self.tables[index]
            rows_before = len(table)
            row = table.add(records)
            placement = Placement(index, row, False, row < rows_before)
        self.where[shape] = (placement.table, placement.row)
        self.where.move_to_end(shape)
        self._bound()
        return placement

    def _bound(self) -> None:
        while self.max_shapes is not None and len(self.where) > self.max_shapes:
            _, (table, row) = self.where.popitem(last=False)
            self.tables[table].release(row)
            self.evicted += 1

    def describe(self) -> list[dict]:
        shapes_of: dict[int, list] = {}
        for shape, (t, _) in self.where.items():
            shapes_of.setdefault(t, []).append(shape)
        return [
            {"nodes": len(table.base), "shapes": len(shapes_of.get(t, [])),
             "rows": len(table), "columns": len(table.columns),
             "table_bytes_uncompressed": table.uncompressed_bytes(),
             "table_bytes_compressed": table.compressed_bytes(),
             "shape_keys": sorted(shapes_of.get(t, []))[:8]}
            for t, table in enumerate(self.tables)
        ]
