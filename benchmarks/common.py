"""CUDA timing and model shapes shared by the GPU benchmarks (kernels, decode_topk); torch only, so a
script can read it before choosing whether triton interprets."""

from __future__ import annotations

import statistics

import torch

# Attention shapes of the benchmarked models: (query heads, KV heads, head dim).
SHAPES = {"llama3-8b": (32, 8, 128), "qwen2.5": (14, 2, 64), "llama3.2-1b": (32, 8, 64),
          "qwen2.5-1.5b": (12, 2, 128)}


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
