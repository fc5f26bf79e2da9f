"""What the executor needs of a backend: record a region at a shape, replay it."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Protocol, Sequence


class RegionBackend(Protocol):
    """Records regions per shape and replays them: ``CpuReplayBackend`` (TVM's CPU kernels
    replayed without the VM), ``CudaGraphBackend`` (CUDA graphs, one per topology or one
    per shape)."""

    name: str
    # Replays read only the addresses of region arguments (the executor may pass
    # ``call_plan.Address`` ints for its own buffers instead of tensor views).
    addresses_only: bool
    # Recording runs the kernels (the VM calls them, the backend watches): to record a
    # region without its effects the executor skips them (a capture runs nothing).
    records_by_running: bool
    launches: int  # replays and recording runs so far
    driver_ns: int  # nanoseconds spent in the calls that launch or run recorded work

    def stream_context(self) -> AbstractContextManager: ...
    def has(self, region: str, shape: tuple) -> bool: ...
    @property
    def shapes_held(self) -> int: ...

    def replay(self, region: str, shape: tuple, region_args: Sequence[Any],
               caller: Any = None, moving: Sequence[int] | None = None,
               guards: Sequence[tuple[Any, Any]] = ()) -> bool:
        """Launch the recording of ``region`` at ``shape``; False if there is none.
        ``caller``: a key equal to the last launch's when only ``moving`` arguments may
        have changed address. ``guards``: ``(condition, expect)`` pairs; the region runs
        only if each 1-byte condition is ``expect``."""

    def ready(self, region: str, shape: tuple) -> Callable[[], None] | None:
        """Right after a ``replay`` of ``region`` at ``shape``: a callable that makes that
        very launch again (same arguments and guards) with less host work, valid until
        the backend records again; None if the backend keeps none (the executor then
        replays)."""

    def begin(self, region: str, shape: tuple, region_args: Sequence[Any]) -> Any:
        """Start recording ``region`` at ``shape``; TVM's VM issues it next."""

    def end(self, recorder: Any, run: bool = True) -> None:
        """Keep the recording; ``run``: its work runs for this call too."""

    def abort(self, recorder: Any) -> None: ...
    def recorded_shapes(self) -> dict[str, list[tuple]]: ...
    def synchronize(self) -> None: ...
    def describe(self) -> dict: ...
    def close(self) -> None: ...
