"""Time a few launches of GPU work with no host launch cost in the figure (torch, CUDA)."""

from __future__ import annotations

import torch


def graph_us(fn, reps: int = 20, replays: int = 5) -> float:
    """us per call of ``fn``: ``reps`` calls captured in one CUDA graph (after one call
    outside it), ``replays`` replays timed by CUDA events."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / (replays * reps)
