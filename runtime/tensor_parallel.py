"""What each rank of a tensor-parallel artifact needs at run time: its part of each input.

``grape_tvm.build(..., tensor_parallel=N)`` compiles the program every rank runs and writes
``plan["tensor_parallel"] = {"world_size": N, "shard_plan": {input: axis}}``: an input the
plan names is split in N equal slices along its axis, rank ``r`` taking the ``r``-th (the
part disco's ``scatter_from_worker0`` would send it); every other input is whole on every
rank.
"""

from __future__ import annotations

from typing import Any, Mapping

PLAN_KEY = "tensor_parallel"  # in an artifact's plan


def rank_part(name: str, value: Any, axis: int, rank: int, world_size: int) -> Any:
    """Rank ``rank``'s slice of ``value`` (a numpy array) along ``axis``."""
    if value.shape[axis] % world_size:
        raise ValueError(f"input {name!r} of shape {tuple(value.shape)} does not split in "
                         f"{world_size} along axis {axis}")
    size = value.shape[axis] // world_size
    index = [slice(None)] * value.ndim
    index[axis] = slice(rank * size, (rank + 1) * size)
    return value[tuple(index)]


def rank_inputs(shard_plan: Mapping[str, int], world_size: int, inputs: Mapping[str, Any],
                rank: int) -> dict[str, Any]:
    """Rank ``rank``'s inputs: each one ``shard_plan`` names, its part; the others whole."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of the {world_size} ranks")
    return {name: value if name not in shard_plan else
            rank_part(name, value, int(shard_plan[name]), rank, world_size)
            for name, value in inputs.items()}
