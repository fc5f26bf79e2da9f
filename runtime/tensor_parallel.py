"""What each rank of a tensor-parallel artifact needs at run time: its part of each input.

``grape_tvm.build(..., tensor_parallel=N)`` compiles the program every rank runs and writes
``plan["tensor_parallel"] = {"world_size": N, "shard_plan": {input: axis},
"output_shard_plan": {output: axis}}``: an input the plan names is split in N equal slices
along its axis, rank ``r`` taking the ``r``-th (the part disco's ``scatter_from_worker0``
would send it); every other input is whole on every rank. An output the plan names comes
out of rank ``r`` as its ``r``-th slice along that axis (a KV cache split by heads); the
others are whole on every rank.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

PLAN_KEY = "tensor_parallel"  # in an artifact's plan
OUTPUTS_KEY = "output_shard_plan"  # in plan[PLAN_KEY]


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


def joined(parts: Any, axis: int) -> Any:
    """The whole of an output from its ranks' slices stacked in rank order (``parts``, a
    numpy array ``(world_size, *slice)``, as disco's ``gather_to_worker0`` leaves them),
    joined along ``axis``."""
    return np.concatenate(list(parts), axis=axis)


def placement_text(axis: int | None) -> str:
    """How a rank holds a value the plans split on ``axis`` (None: not split), in words."""
    return "whole" if axis is None else f"split along axis {axis}"
