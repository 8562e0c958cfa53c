"""Where does ``decode_mode=spans`` lose a needle? Per-layer diagnostics of one decode step (issue 24).

For one decode query of one layer, given the state the backend's references build (span ids,
kept NMS intervals, span keys, persistent flags, index tokens; top-k page min/max summaries), this
reports, per KV head, where the needle's pages stand:

* ``exact``: rank of the best needle page by the exact attention mass of the decode query
  (softmax over every key, summed over the KV head's query heads), and the needle pages' share
  of that mass;
* ``topk``: rank under the top-k mode's Quest bound (``topk_decode.reference_page_bounds``);
* ``span_sum``: rank under the span mode's score ``q . span_key`` (the sum of the span's index
  keys, what ``reference_select_span_pages`` sorts by);
* ``span_mean``: rank under ``q . mean of the span's index keys``;
* ``span_max``: rank under the best index token of the span, ``max_t q . k_t`` (the group's query
  heads summed before the dot product, as the other span scores);
* with the division's votes (``votes``, per prompt token: the local maps' column sums, by which
  a span picks its index tokens): ``vote_rank``, the rank of the best needle token among its span's
  tokens by votes (the index count a span would need to index it), and two what-if scores at
  token rather than span granularity, each page indexed by its own ``n`` most-voted tokens and
  scored by the best of them (``page_idx1`` / ``page_idx2``: 1 or 2 tokens per page, the memory
  of the span key / of the top-k mode's min and max);
* with the top-k page summaries (``summaries``: min, max ``[pages, Hkv, D]``): ``span_bound``, the
  rank under a per-span Quest bound (the min / max over every key of the span, each page scored
  by its span's bound, ``topk_decode.reference_page_bounds``), the "per-span bounds instead of one
  summed key" of the issue;
* whether the needle pages are inside an NMS-kept interval (or a gap run), the length of their
  span, its index-token count, whether any needle token is an index token, whether a needle page
  is flagged persistent, and whether the spans / top-k selections contain a needle page.

Ranks are 0-based among the pages a selection chooses from (sink and recent pages excluded),
ties to the lower page; a needle page that is forced (sink / recent) ranks 0.
"""

from __future__ import annotations

import torch


def find_subsequence(seq: list[int], sub: list[int]) -> list[int]:
    """Start positions of ``sub`` in ``seq``."""
    n = len(sub)
    return [i for i in range(len(seq) - n + 1) if seq[i:i + n] == sub]


def candidate_mask(n_pages: int, sink_pages: int, recent_pages: int) -> torch.Tensor:
    j = torch.arange(n_pages)
    return (j >= sink_pages) & (j < n_pages - recent_pages)


def best_rank(score: torch.Tensor, targets: list[int], candidates: torch.Tensor) -> int:
    """0-based rank of the best of ``targets`` among the candidate pages by descending ``score``
    (stable: ties to the lower page); 0 if a target is not a candidate (forced)."""
    if any(not bool(candidates[t]) for t in targets):
        return 0
    idx = candidates.nonzero()[:, 0]
    order = idx[torch.argsort(score[idx].double(), descending=True, stable=True)].tolist()
    return min(order.index(t) for t in targets)


def exact_page_mass(q: torch.Tensor, k: torch.Tensor, scale: float, page_size: int) -> torch.Tensor:
    """float64 ``[Hkv, pages]``: softmax(q k^T scale) of one query per head over all keys, summed
    per page and over the KV head's query heads. q ``[H, D]``, k ``[Hkv, L, D]``."""
    h, d = q.shape
    hkv, length, _ = k.shape
    group = h // hkv
    p = torch.softmax(torch.einsum("kgd,kld->kgl", q.double().view(hkv, group, d), k.double()) * scale, -1)
    p = p.sum(1)  # [Hkv, L]
    n_pages = -(-length // page_size)
    padded = p.new_zeros(hkv, n_pages * page_size)
    padded[:, :length] = p
    return padded.view(hkv, n_pages, page_size).sum(-1)


def probe_layer(q: torch.Tensor, k: torch.Tensor, scale: float, page_size: int, needle_pages: list[int],
                needle_tokens: list[int], *, span_ids: list[int], in_kept: list[bool], index_tokens: list[int],
                span_count: dict[int, int], span_keys: torch.Tensor, flags: torch.Tensor,
                topk_bounds: torch.Tensor, spans_selected: torch.Tensor, topk_selected: torch.Tensor,
                sink_pages: int, recent_pages: int, votes: torch.Tensor | None = None,
                summaries: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """Diagnostics of one layer's decode step (see the module doc). q ``[H, D]``, k ``[Hkv, L,
    D]`` (the cache, the step's key last); ``span_ids``/``in_kept`` per prompt page (global span
    id = its first page); ``index_tokens`` global positions; ``span_count`` index tokens per span
    id; ``span_keys`` ``[pages, Hkv, D]``; ``flags`` ``[pages, Hkv]``; ``topk_bounds`` ``[Hkv,
    pages]``; ``*_selected`` ``[Hkv, width]`` logical pages (-1 padding)."""
    h, d = q.shape
    hkv, length, _ = k.shape
    group = h // hkv
    n_prompt_pages = len(span_ids)
    n_pages = -(-length // page_size)
    cand = candidate_mask(n_pages, sink_pages, recent_pages)
    mass = exact_page_mass(q, k, scale, page_size)
    qg = q.double().view(hkv, group, d).sum(1)  # [Hkv, D]
    index_set = set(index_tokens)
    by_span: dict[int, list[int]] = {}
    for t in index_tokens:
        by_span.setdefault(span_ids[t // page_size], []).append(t)
    span_bound = None
    if summaries is not None:
        from vllm_sparse_kernels.reference import topk_decode  # its torch references

        smin, smax = (x[:n_pages].double().clone() for x in summaries)
        ids = torch.tensor(span_ids)
        for sid in set(span_ids):
            pages = (ids == sid).nonzero()[:, 0]
            smin[pages] = smin[pages].amin(0)
            smax[pages] = smax[pages].amax(0)
        span_bound = topk_decode.reference_page_bounds(q, smin, smax, torch.arange(n_pages), group)  # [Hkv, P]
    heads = []
    for g in range(hkv):
        keys = span_keys[:n_pages, g].double()
        s_sum = keys @ qg[g]
        counts = torch.tensor([float(span_count.get(span_ids[p], 1)) if p < n_prompt_pages else 1.0
                               for p in range(n_pages)], dtype=torch.float64)
        s_mean = s_sum / counts
        tok_scores = k[g].double() @ qg[g]  # [L]
        s_max = s_sum.clone()  # pages without a span (decode-written) keep their fallback score
        for p in range(n_prompt_pages):
            toks = by_span.get(span_ids[p], [])
            s_max[p] = tok_scores[toks].max() if toks else float("-inf")
        needle_span = span_ids[needle_pages[0]]
        extra = {}
        if votes is not None:
            span_tokens = [t for t in range(n_prompt_pages * page_size) if t < votes.shape[0]
                           and span_ids[t // page_size] == needle_span]
            order = sorted(span_tokens, key=lambda t: (-float(votes[t]), t))
            # a needle crossing a span boundary: its tokens in the first needle page's span
            extra["vote_rank"] = min(order.index(t) for t in needle_tokens if span_ids[t // page_size] == needle_span)
            for n_idx in (1, 2):
                s_page = s_sum.clone()
                for p in range(n_prompt_pages):
                    toks = list(range(p * page_size, min((p + 1) * page_size, votes.shape[0])))
                    best = sorted(toks, key=lambda t: (-float(votes[t]), t))[:n_idx]
                    s_page[p] = tok_scores[best].max()
                extra[f"page_idx{n_idx}_rank"] = best_rank(s_page, needle_pages, cand)
        if span_bound is not None:
            extra["span_bound_rank"] = best_rank(span_bound[g], needle_pages, cand)
        heads.append({**extra,
            "exact_rank": best_rank(mass[g], needle_pages, cand),
            "exact_mass": float(mass[g, needle_pages].sum()),
            "topk_rank": best_rank(topk_bounds[g], needle_pages, cand),
            "span_sum_rank": best_rank(s_sum, needle_pages, cand),
            "span_mean_rank": best_rank(s_mean, needle_pages, cand),
            "span_max_rank": best_rank(s_max, needle_pages, cand),
            "persistent": any(bool(flags[p, g]) for p in needle_pages),
            "spans_selected": any(p in spans_selected[g].tolist() for p in needle_pages),
            "topk_selected": any(p in topk_selected[g].tolist() for p in needle_pages),
            "needle_span_pages": sum(1 for s in span_ids if s == needle_span),
            "needle_span_index": span_count.get(needle_span, 0),
        })
    kept_pages = sum(in_kept)
    spans = sorted(set(span_ids))
    return {
        "heads": heads,
        "needle_in_kept_span": any(in_kept[p] for p in needle_pages),
        "needle_token_is_index": any(t in index_set for t in needle_tokens),
        "spans": len(spans),
        "kept_page_share": kept_pages / n_prompt_pages,
        "mean_span_pages": n_prompt_pages / len(spans),
        "index_tokens": len(index_tokens),
    }


def format_rows(layers: dict[int, dict]) -> list[str]:
    """One line per layer; per-head values joined by '/'."""
    def per_head(r, key, fmt="{}"):
        return "/".join(fmt.format(h[key]) if key in h else "-" for h in r["heads"])

    def flag(r, key):
        return "".join("y" if h[key] else "." for h in r["heads"])

    lines = [f"{'layer':>5} {'exact':>9} {'mass':>11} {'topk':>9} {'span_sum':>9} {'span_mean':>9} "
             f"{'span_max':>9} {'spanbnd':>9} {'vote':>7} {'pidx1':>9} {'pidx2':>9} {'kept':>4} {'idx':>3} {'spanpg':>7} {'nidx':>6} {'pers':>4} {'selS':>4} "
             f"{'selT':>4} {'spans':>5} {'keptpg':>6} {'pg/span':>7}"]
    for layer, r in sorted(layers.items()):
        lines.append(
            f"{layer:>5} {per_head(r, 'exact_rank'):>9} {per_head(r, 'exact_mass', '{:.3f}'):>11} "
            f"{per_head(r, 'topk_rank'):>9} {per_head(r, 'span_sum_rank'):>9} {per_head(r, 'span_mean_rank'):>9} "
            f"{per_head(r, 'span_max_rank'):>9} {per_head(r, 'span_bound_rank'):>9} {per_head(r, 'vote_rank'):>7} "
            f"{per_head(r, 'page_idx1_rank'):>9} {per_head(r, 'page_idx2_rank'):>9} {'y' if r['needle_in_kept_span'] else '.':>4} "
            f"{'y' if r['needle_token_is_index'] else '.':>3} {per_head(r, 'needle_span_pages'):>7} "
            f"{per_head(r, 'needle_span_index'):>6} {flag(r, 'persistent'):>4} {flag(r, 'spans_selected'):>4} "
            f"{flag(r, 'topk_selected'):>4} {r['spans']:>5} {r['kept_page_share']:>6.2f} {r['mean_span_pages']:>7.1f}")
    return lines


RANKS = ("exact_rank", "topk_rank", "span_sum_rank", "span_mean_rank", "span_max_rank", "span_bound_rank",
         "page_idx1_rank", "page_idx2_rank", "vote_rank")


def needle_positions(prompt_ids: list[int], values: list[str], encode) -> tuple[list, list]:
    """Token positions of each expected value in the prompt: ``[(value, [positions])]`` for the values
    found exactly once (in ``values``' order), and ``[(value, count)]`` for those found 0 or 2+ times."""
    found, missing = [], []
    for value in values:
        ids = list(encode(value))
        starts = find_subsequence(prompt_ids, ids)
        if len(starts) == 1:
            found.append((value, list(range(starts[0], starts[0] + len(ids)))))
        else:
            missing.append((value, len(starts)))
    return found, missing


def summarise(prompts: list[dict], groups: dict[str, list[int]], budget: int) -> list[str]:
    """Per group of layers, over prompts and KV heads: median of each rank and the share below
    ``budget``; shares of needle pages selected / persistent; needle span size."""
    import statistics

    lines = []
    for name, layers in groups.items():
        rows = [(p["layers"][str(layer)], h) for p in prompts for layer in layers if str(layer) in p["layers"]
                for h in p["layers"][str(layer)]["heads"]]
        if not rows:
            continue
        lines.append(f"layers {name} ({len(rows)} layer x head x prompt):")
        for key in RANKS:
            vals = [h[key] for _, h in rows if key in h]
            if vals:
                lines.append(f"  {key:<16} median {statistics.median(vals):6.1f}   below {budget}: "
                             f"{sum(v < budget for v in vals) / len(vals):.2f}")
        for key in ("spans_selected", "topk_selected", "persistent"):
            lines.append(f"  {key:<16} share {sum(h[key] for _, h in rows) / len(rows):.2f}")
        span = [h["needle_span_pages"] for _, h in rows]
        lines.append(f"  needle span pages median {statistics.median(span)} (min {min(span)}, max {max(span)}); "
                     f"needle in a kept span {sum(r['needle_in_kept_span'] for r, _ in rows) / len(rows):.2f}; "
                     f"a needle token is an index token {sum(r['needle_token_is_index'] for r, _ in rows) / len(rows):.2f}")
    return lines
