"""Transfer budget of top-k decoding with the KV cache offloaded to CPU memory (issue 8, item 4).

A model: per decode step and layer, each KV head picks its top-k keys outside the always-resident
sinks and local window; the pages holding them must be on the GPU. Pages already in a GPU page
cache (hit rate ``h``) cost nothing; the rest cross PCIe. The selection for layer l + 1 needs
layer l's output and attention needs the pages, so a layer's copies cannot hide behind other work
of the same step: they add to the step time (prefetching the previous step's pages is what the
page cache and its hit rate stand for). The page scores cost one read of every page summary per
step. Prints, per context length, k and hit rate, the bytes per step, the transfer time, the step
time (weight reads + summary scan + transfer) against the step without offloading, and whether it
keeps up (at most ``--max-slowdown`` slower, and the GPU holds weights, sinks + window, page cache
and page summaries in 90% of its memory).

Inputs are parameters, not measurements, except ``--trace``: the JSON of
``benchmarks/studies/decode_topk_trace.py`` (measured page utilisation and LRU hit rates on a real
model), whose numbers then replace ``--utilisation``, ``--hit`` and ``--union`` (the hit rate
of its LRU cache of ``--cache-factor`` x a step's pages).

    python -m benchmarks.studies.offload_sim                      # Llama-3-8B shape, int8 weights, 16 GB GPU
    python -m benchmarks.studies.offload_sim --trace benchmarks/results/decode_topk_trace_cpu_qwen-coder_8192_*.json
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import pathlib
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    params: float  # weights, count
    kv_bytes: int = 2  # bf16 K/V

    def kv_bytes_per_token(self) -> int:
        """K and V of one token, all layers and KV heads."""
        return self.layers * self.kv_heads * 2 * self.head_dim * self.kv_bytes


LLAMA3_8B = Shape(layers=32, kv_heads=8, head_dim=128, params=8.03e9)


@dataclass(frozen=True)
class Machine:
    gpu_bytes: float  # GPU memory
    hbm_bw: float  # GPU memory bandwidth, bytes/s
    pcie_bw: float  # effective host->device bandwidth for page-sized gathers, bytes/s


@dataclass(frozen=True)
class Step:
    context: int  # tokens in the offloaded context
    topk_frac: float  # selected keys per (layer, KV head), as a share of the context
    page: int  # tokens per page
    utilisation: float  # selected tokens / tokens of the pages that hold them
    hit: float  # share of a step's selected pages already in the GPU page cache
    union: float = 1.0  # selected tokens per KV head / k: the union over the group's query heads


def page_bytes(shape: Shape, page: int) -> int:
    """K and V of one page of one KV head in one layer."""
    return page * 2 * shape.head_dim * shape.kv_bytes


def pages_per_head(s: Step) -> float:
    """Pages one (layer, KV head) needs per step."""
    return s.context * s.topk_frac * s.union / (s.page * s.utilisation)


def transfer_bytes(shape: Shape, s: Step) -> float:
    """Bytes crossing PCIe per decode step (all layers and KV heads), missed pages only."""
    return shape.layers * shape.kv_heads * pages_per_head(s) * (1.0 - s.hit) * page_bytes(shape, s.page)


def weight_read_seconds(shape: Shape, m: Machine, weight_bytes: float) -> float:
    """A batch-1 decode step reads every weight once: the step's floor without offloading."""
    return shape.params * weight_bytes / m.hbm_bw


def resident_bytes(shape: Shape, s: Step, weight_bytes: float, window: int, cache_factor: float,
                   summary_bytes: float) -> dict[str, float]:
    """GPU memory: weights, sinks + window KV, page cache (``cache_factor`` x a step's pages per
    head), page summaries (``summary_bytes`` per page and KV head, every page of the context)."""
    return {
        "weights": shape.params * weight_bytes,
        "window": window * shape.kv_bytes_per_token(),
        "page cache": shape.layers * shape.kv_heads * cache_factor * pages_per_head(s) * page_bytes(shape, s.page),
        "summaries": shape.layers * shape.kv_heads * math.ceil(s.context / s.page) * summary_bytes,
    }


def trace_points(pattern: str, page: int, cache_factor: float) -> list[tuple[float, float, float, float]]:
    """(k share, utilisation, hit rate, union factor) per k measured at this page size, from a
    ``decode_topk_trace.py`` JSON (hit rate of its LRU cache of ``cache_factor`` x a step's pages)."""
    paths = sorted(glob.glob(pattern))
    if not paths:
        raise SystemExit(f"--trace {pattern}: no such file")
    results = json.loads(pathlib.Path(paths[-1]).read_text())["results"]
    key = f"hit_{cache_factor:g}x"
    points = []
    for frac, by_page in sorted(results.items(), key=lambda kv: float(kv[0])):
        m = by_page.get(str(page), {}).get("mean")
        if m is None:
            continue
        if key not in m:
            raise SystemExit(f"{paths[-1]}: no {key} (measured: {sorted(k for k in m if k.startswith('hit_'))})")
        points.append((float(frac), m["util"], m[key], m["sel_tokens"] / by_page[str(page)]["k"]))
    if not points:
        raise SystemExit(f"{paths[-1]}: nothing measured at page {page}")
    return points


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[131072, 262144, 1048576])
    ap.add_argument("--topk", type=float, nargs="+", default=[0.001, 0.01], help="share of the context")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--utilisation", type=float, default=0.3, help="selected / fetched tokens")
    ap.add_argument("--hit", type=float, nargs="+", default=[0.5, 0.8, 0.95])
    ap.add_argument("--union", type=float, default=1.0,
                    help="selected tokens per KV head / k (GQA: union over the group's query heads)")
    ap.add_argument("--weight-bytes", type=float, default=1.0, help="per parameter (1 = int8)")
    ap.add_argument("--gpu-gb", type=float, default=16.0)
    ap.add_argument("--hbm-gbs", type=float, default=700.0, help="GPU memory bandwidth, GB/s")
    ap.add_argument("--pcie-gbs", type=float, default=20.0, help="effective PCIe gather rate, GB/s")
    ap.add_argument("--window", type=int, default=4096 + 64, help="always-resident tokens (window + sinks)")
    ap.add_argument("--cache-factor", type=float, default=2.0, help="page cache, x a step's pages per head")
    ap.add_argument("--summary-bytes", type=float, default=128.0, help="per page and KV head (int8 mean key)")
    ap.add_argument("--max-slowdown", type=float, default=0.25)
    ap.add_argument("--trace", help="decode_topk_trace JSON (glob): measured utilisation and hit rates")
    args = ap.parse_args(argv)

    shape = LLAMA3_8B
    m = Machine(args.gpu_gb * GB, args.hbm_gbs * GB, args.pcie_gbs * GB)
    base = weight_read_seconds(shape, m, args.weight_bytes)
    points = [(k, args.utilisation, h, args.union) for k in args.topk for h in args.hit]
    if args.trace:
        points = trace_points(args.trace, args.page, args.cache_factor)
    print(f"Llama-3-8B shape ({shape.kv_bytes_per_token() / 1e3:.0f} KB of KV per token), "
          f"{args.weight_bytes:g} B/weight, GPU {args.gpu_gb:g} GB at {args.hbm_gbs:g} GB/s, PCIe "
          f"{args.pcie_gbs:g} GB/s, page {args.page}; step without offloading {base * 1e3:.1f} ms")
    print("| context | k | union | utilisation | hit | pages / head | MB / step | transfer ms | step ms | "
          "slowdown | keeps up | GPU GB (w / win / cache / summ) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.contexts:
        for k, u, h, g in points:
            s = Step(n, k, args.page, u, h, g)
            b = transfer_bytes(shape, s)
            t = b / m.pcie_bw
            mem = resident_bytes(shape, s, args.weight_bytes, args.window, args.cache_factor, args.summary_bytes)
            step = base + mem["summaries"] / m.hbm_bw + t
            fits = sum(mem.values()) <= m.gpu_bytes * 0.9
            ok = step / base - 1 <= args.max_slowdown and fits
            print(f"| {n // 1024}K | {k:.2%} | {g:.1f} | {u:.2f} | {h:.2f} | {pages_per_head(s):.0f} | {b / 1e6:.0f} | "
                  f"{t * 1e3:.1f} | {step * 1e3:.1f} | {step / base - 1:+.0%} | {'yes' if ok else 'no'} | "
                  f"{' / '.join(f'{v / GB:.1f}' for v in mem.values())}{'' if fits else ' (does not fit)'} |")
    print(f"\nHost memory for the offloaded KV: {max(args.contexts) * shape.kv_bytes_per_token() / GB:.0f} GB "
          f"(pinned) at {max(args.contexts) // 1024}K tokens.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
