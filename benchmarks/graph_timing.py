"""Kernel time without the host's launch overhead: calls captured in one CUDA graph, replayed.

Timing a kernel of a few microseconds call by call measures Python and the launch, not the
kernel. Captured back to back in one graph, as a decode step replays its layers, the calls run
as they do in serving.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["us_per_call"]


def us_per_call(call: Callable[[int], object], repeats: int) -> float:
    """Microseconds per call of ``call(i)`` for ``i`` in ``range(repeats)``, captured in one CUDA
    graph after two eager calls (compilation, warm-up); the best of three replays."""
    for i in range(2):
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(repeats):
            call(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / repeats)
    return best
