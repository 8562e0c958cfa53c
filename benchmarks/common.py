"""CUDA timing shared by the GPU benchmarks (kernels, decode_topk, decode_spans, the studies)."""

from __future__ import annotations

import statistics

import torch


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph (after one run on a side stream, as torch requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def event_median(fn, reps: int, before=None) -> float:
    """Median CUDA-event milliseconds of ``reps`` calls of ``fn``, each waited for; ``before``
    (untimed, e.g. an L2 flush) runs ahead of each call. The timing loop of every benchmark here."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
