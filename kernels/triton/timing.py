"""CUDA-graph replay timing, shared by the GPU check and the CUDA tuning target."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def graph_replay_ms(fn: Callable[[], object], repeats: int, warmup: int, settle: int = 1) -> float:
    """Median CUDA-event time (ms) of ``repeats`` replays of a CUDA graph of ``fn``.

    ``fn`` runs ``warmup`` times eagerly on a side stream first (compilation and allocation stay
    out of the graph and the numbers), then the graph is captured and replayed ``settle`` times
    untimed before the timed replays.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(settle):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
