"""Benchmark: ``topk_select.topk_ascending`` (Triton radix select, ascending columns) vs torch
(``topk(k, sorted=False).indices.sort(-1)``) on fp32 rows.

Shapes: the prefill index estimation (R = 8 KV heads or 32 query heads, N = 128K / 512K keys,
k = 6096 slashes / 1000 verticals) and the decode page selection (R = 8 sequences x 32 heads,
N = 8192 pages, k = 170). Scores: uniform^4 with the first 64 columns +inf (forced entries).

Times: CUDA events around one call, median of ``--reps`` after a warm-up; "eager" includes the
host launch cost where the GPU waits for it, "graph" replays the call captured in a CUDA graph
(the decode path). Prints a markdown table; exits 0 without CUDA.

"host" is the host time per call when launches queue back to back (the eager floor: Triton's
launch cost). ``--sweep`` also times graph replays for tile sizes, warps and programs per SM.

Run where the package is installed: ``python -m benchmarks.studies.topk_select_bench [--reps 20] [--sweep]``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks.common import capture_graph, event_median

SHAPES = [(8, 128 * 1024, 6096), (8, 512 * 1024, 6096), (8, 128 * 1024, 1000), (32, 128 * 1024, 6096),
          (8 * 32, 8192, 170)]


def time_ms(fn, reps: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return event_median(fn, reps)


def graphed(fn):
    return capture_graph(fn).replay


def host_us(fn, reps: int) -> float:
    """Host time per call (launches only, the GPU queue never drains): the eager floor."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / reps * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true",
                    help="also time (graph-replayed) tile sizes, warps and programs per SM")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to time")
        return 0
    from vllm_sparse_kernels import topk_select as ts
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print()
    print("| R | N | k | torch topk+sort eager (us) | ours eager (us) | ours host (us) | ours graph (us) "
          "| torch graph (us) | speedup eager |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    inputs = []
    for R, N, k in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        scores = torch.rand(R, N, device="cuda", generator=gen) ** 4
        scores[:, :64] = float("inf")
        inputs.append((R, N, k, scores))

        def ours():
            return ts.topk_ascending(scores, k)

        def ref():
            return scores.topk(k, dim=-1, sorted=False).indices.sort(-1).values

        mine, want = ours()[0].long(), ref()
        # the same multiset of kept scores (ties may pick other columns)
        same = torch.equal(scores.gather(1, mine).sort(-1).values, scores.gather(1, want).sort(-1).values)
        assert same and bool((mine.diff(dim=-1) > 0).all()), f"mismatch at R={R} N={N} k={k}"
        t_ref = time_ms(ref, args.reps) * 1e3
        t_ours = time_ms(ours, args.reps) * 1e3
        t_host = host_us(ours, args.reps)
        t_ours_g = time_ms(graphed(ours), args.reps) * 1e3
        t_ref_g = time_ms(graphed(ref), args.reps) * 1e3
        print(f"| {R} | {N} | {k} | {t_ref:.1f} | {t_ours:.1f} | {t_host:.1f} | {t_ours_g:.1f} | {t_ref_g:.1f} | "
              f"{t_ref / t_ours:.1f}x |")
    if args.sweep:
        defaults = (ts._BLOCK, ts._WARPS, ts._PROGRAMS_PER_SM)
        print()
        print("| block | warps | programs/SM | " + " | ".join(f"{R}x{N // 1024}K k={k} graph (us)"
                                                        for R, N, k, _ in inputs) + " |")
        print("|" + " --- |" * (3 + len(inputs)))
        for blk in (2048, 4096, 8192):
            for warps in (4, 8, 16):
                for pps in (1, 2, 4):
                    ts._BLOCK, ts._WARPS, ts._PROGRAMS_PER_SM = blk, warps, pps
                    row = [time_ms(graphed(lambda: ts.topk_ascending(x, k)), args.reps) * 1e3
                           for R, N, k, x in inputs]
                    print(f"| {blk} | {warps} | {pps} | " + " | ".join(f"{t:.1f}" for t in row) + " |")
        ts._BLOCK, ts._WARPS, ts._PROGRAMS_PER_SM = defaults
    return 0

if __name__ == "__main__":
    sys.exit(main())
