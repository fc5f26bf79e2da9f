"""Where a recorded kernel argument comes from when its region is replayed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import tvm


@dataclass(frozen=True)
class ArgSlot:
    """A kernel argument: the region's ``param``-th argument, or a fixed ``value``."""

    param: int | None
    value: Any = None


def _same_tensor(a: Any, b: Any) -> bool:
    return (a.data_ptr() == b.data_ptr() and tuple(a.shape) == tuple(b.shape)
            and str(a.dtype) == str(b.dtype))


def slots_for(args: Sequence[Any], region_args: Sequence[Any]) -> tuple[ArgSlot, ...]:
    """Map each kernel argument to a region parameter when it is one, else keep the value.

    Tensors that are not region parameters are constants of the compiled module (weights):
    holding them here keeps them alive for as long as the recording is.
    """
    tensors = [(i, a) for i, a in enumerate(region_args) if isinstance(a, tvm.runtime.Tensor)]
    slots = []
    for arg in args:
        if isinstance(arg, tvm.runtime.Tensor):
            match = next((i for i, t in tensors if _same_tensor(arg, t)), None)
            slots.append(ArgSlot(match, None if match is not None else arg))
        else:
            slots.append(ArgSlot(None, arg))
    return tuple(slots)


def bind_slots(slots: Sequence[ArgSlot], region_args: Sequence[Any]) -> list[Any]:
    return [region_args[s.param] if s.param is not None else s.value for s in slots]
