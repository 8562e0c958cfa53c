"""Plain torch references of the span-retrieval decode kernels
(:mod:`vllm_sparse_kernels.decode.span_decode`): float64, loops, small sizes; independent of the
kernels' vectorised formulations. Torch only (the settings type is only named, never imported at
run time: the kernel module imports triton).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..decode.span_decode import SpanParams


def reference_local_map(q: torch.Tensor, k: torch.Tensor, page_size: int, scale: float,
                        segment_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One segment: q ``[n_tok, H, D]``, k ``[n_tok, Hkv, D]`` -> float64 page map ``[n, n]`` and
    votes ``[segment_tokens]`` (softmax over the segment's causal keys, summed over heads)."""
    n_tok, h, _ = q.shape
    group = h // k.shape[1]
    n = segment_tokens // page_size
    maps = torch.zeros(n, n, dtype=torch.float64)
    votes = torch.zeros(segment_tokens, dtype=torch.float64)
    for head in range(h):
        s = q[:, head].double().cpu() @ k[:, head // group].double().cpu().T * scale
        s = s.masked_fill(torch.ones(n_tok, n_tok, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.softmax(s, -1)
        votes[:n_tok] += p.sum(0)
        for a in range(-(-n_tok // page_size)):
            for b in range(a + 1):
                maps[a, b] += p[a * page_size:(a + 1) * page_size, b * page_size:(b + 1) * page_size].sum()
    return maps, votes


def reference_nms(x: list[int], y: list[int], score: list[float], iou: float) -> list[bool]:
    """Greedy NMS over candidates given in score order (descending)."""
    kept: list[int] = []
    out = []
    for i in range(len(x)):
        ok = score[i] > 0 and y[i] >= x[i]
        for j in kept:
            inter = max(0, min(y[i], y[j]) - max(x[i], x[j]) + 1)
            union = (y[i] - x[i] + 1) + (y[j] - x[j] + 1) - inter
            if inter > iou * union:
                ok = False
                break
        out.append(ok)
        if ok:
            kept.append(i)
    return out


def reference_divide(maps: torch.Tensor, votes: torch.Tensor, n_tok: int, page_size: int, num_heads: int,
                     params: SpanParams, info: dict | None = None) -> tuple[list[int], list[int]]:
    """One segment, with loops: (span id of every page — its span's first page —, index token
    positions). Independent of ``span_decode.divide_segments`` (explicit triangle sums, Python NMS).
    ``info``, if given, receives diagnostics: ``theta``, ``kept`` (the NMS-kept page intervals),
    ``in_kept`` (per page: inside a kept interval rather than a gap run) and per span id its
    ``ratio`` (r_a) and index-token ``count``."""
    maps = maps.double().tolist()  # plain floats: the loops below index them millions of times
    n_pages = -(-n_tok // page_size)
    pt = [min(page_size, n_tok - a * page_size) for a in range(n_pages)]
    cells = {}
    for a in range(n_pages):
        for b in range(a + 1):
            cells[a, b] = (pt[a] * pt[b] if b < a else pt[a] * (pt[a] + 1) / 2) * num_heads
    means = torch.tensor([maps[a][b] / c for (a, b), c in cells.items()], dtype=torch.float64)
    theta = float(torch.quantile(means, params.theta_quantile))
    total = sum(maps[a][b] for (a, b) in cells)
    theta = max(theta, total / sum(cells.values()))  # never below the mean cell value

    def tri(x, y, th):
        return sum(maps[a][b] - th * cells[a, b] for a in range(x, y + 1) for b in range(x, a + 1))

    cands = []
    for d in range(2 * n_pages - 1):
        best = None
        for x in range(max(0, d - n_pages + 1), d // 2 + 1):
            sc = tri(x, d - x, theta)
            if best is None or sc > best[0]:
                best = (sc, x, d - x, d)
        cands.append(best)
    cands.sort(key=lambda c: (-c[0], c[3]))
    keep = reference_nms([c[1] for c in cands], [c[2] for c in cands], [c[0] for c in cands], params.iou)
    kept = [c for c, k in zip(cands, keep) if k]
    owner = [next((i for i, c in enumerate(kept) if c[1] <= a <= c[2]), None) for a in range(n_pages)]
    span, interval = [0] * n_pages, [(0, 0)] * n_pages
    for a in range(n_pages):
        if owner[a] is not None:
            span[a] = min(b for b in range(n_pages) if owner[b] == owner[a])
            interval[a] = kept[owner[a]][1:3]
        else:
            lo = a
            while lo > 0 and owner[lo - 1] is None:
                lo -= 1
            hi = a
            while hi < n_pages - 1 and owner[hi + 1] is None:
                hi += 1
            span[a], interval[a] = lo, (lo, hi)
    selected = []
    if info is not None:
        info.update(theta=theta, kept=[tuple(c[1:3]) for c in kept], in_kept=[o is not None for o in owner],
                    ratio={}, count={})
    for sid in sorted(set(span)):
        pages = [a for a in range(n_pages) if span[a] == sid]
        x, y = interval[pages[0]]
        inside = tri(x, y, 0.0)
        neigh = sum(maps[a][b] for a in range(x, y + 1) for b in range(0, x))
        ratio = inside / (inside + neigh) if inside + neigh > 0 else 1.0
        tokens = [t for a in pages for t in range(a * page_size, a * page_size + pt[a])]
        want = round(len(tokens) * math.exp(-params.lam * (1.0 - ratio)))
        count = min(max(want, params.min_index), params.max_index, len(tokens))
        if info is not None:
            info["ratio"][sid], info["count"][sid] = ratio, count
        vote = votes.double().tolist()
        ranked = sorted(tokens, key=lambda t: (-vote[t], t))
        selected += ranked[:count]
    return span, sorted(selected)


def reference_span_keys(q: torch.Tensor, k: torch.Tensor, page_size: int, scale: float,
                        params: SpanParams) -> tuple[torch.Tensor, list[int]]:
    """Span keys of one sequence's chunk that starts page-aligned: q ``[n, H, D]``, k ``[n, Hkv,
    D]`` -> float64 ``[pages, Hkv, D]`` per page (sum of its span's index keys; ``index="page"``:
    the key of the page's most-voted token), and the span id
    of every page (segment-local ids offset by the segment's first page)."""
    n_tok, h, _ = q.shape
    seg = params.segment_tokens
    n_pages = -(-n_tok // page_size)
    out = torch.zeros(n_pages, k.shape[1], k.shape[2], dtype=torch.float64)
    span_ids = []
    for s0 in range(0, n_tok, seg):
        s1 = min(n_tok, s0 + seg)
        maps, votes = reference_local_map(q[s0:s1], k[s0:s1], page_size, scale, seg)
        span, selected = reference_divide(maps, votes, s1 - s0, page_size, h, params)
        p0 = s0 // page_size
        for a, sid in enumerate(span):
            if params.index == "page":
                n_a = min(page_size, s1 - s0 - a * page_size)
                toks = [max(range(a * page_size, a * page_size + n_a), key=lambda t: (float(votes[t]), -t))]
            else:
                toks = [t for t in selected if span[t // page_size] == sid]
            out[p0 + a] = k[[s0 + t for t in toks]].double().cpu().sum(0)
            span_ids.append(p0 + sid)
    return out, span_ids


def reference_select_span_pages(q: torch.Tensor, span_keys: torch.Tensor, flags: torch.Tensor,
                                block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, *,
                                sink_pages: int, recent_pages: int, persist_pages: int,
                                num_pages_budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``span_decode.select_span_pages``, by sorting float64 scores (stable: ties go to
    the lower page). Inputs must not force more pages than the width."""
    batch, h, _ = q.shape
    hkv = span_keys.shape[1]
    group = h // hkv
    width = sink_pages + recent_pages + persist_pages + num_pages_budget
    selected = torch.full((batch, hkv, width), -1, dtype=torch.int32)
    counts = torch.zeros(batch, hkv, dtype=torch.int32)
    for b in range(batch):
        n_pages = -(-int(seq_lens[b]) // page_size)
        phys = block_table[b, :n_pages].long().cpu()
        for g in range(hkv):
            qg = q[b, g * group:(g + 1) * group].double().cpu().sum(0)
            score = span_keys[phys, g].double().cpu() @ qg
            forced = [j < sink_pages or j >= n_pages - recent_pages or bool(flags[phys[j], g]) for j in range(n_pages)]
            order = [j for j in range(n_pages) if forced[j]]
            rest = sorted((j for j in range(n_pages) if not forced[j]), key=lambda j: (-float(score[j]), j))
            chosen = sorted((order + rest)[:width])
            selected[b, g, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
            counts[b, g] = len(chosen)
    return selected, counts
