"""Plain torch references of the top-k decode kernels (:mod:`vllm_sparse_kernels.decode.topk_decode`):
float64, loops over sequences, small sizes. Torch only.
"""

from __future__ import annotations

import torch


def reference_page_summaries(key_cache: torch.Tensor, block_table: torch.Tensor,
                             seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 min / max ``[num_pages, Hkv, D]`` over the valid keys of every page of every
    sequence (NaN for pages of no sequence), and a bool ``[num_pages]`` of the pages covered."""
    num_pages, page, hkv, d = key_cache.shape
    smin = torch.full((num_pages, hkv, d), float("nan"), dtype=torch.float64, device=key_cache.device)
    smax = smin.clone()
    covered = torch.zeros(num_pages, dtype=torch.bool, device=key_cache.device)
    for b in range(seq_lens.shape[0]):
        n = int(seq_lens[b])
        n_pages = -(-n // page)
        phys = block_table[b, :n_pages].to(torch.int64)
        k = key_cache[phys].double()  # [n_pages, page, Hkv, D]
        valid = (torch.arange(n_pages * page, device=k.device) < n).view(n_pages, page, 1, 1)
        smin[phys] = torch.where(valid, k, float("inf")).amin(1)
        smax[phys] = torch.where(valid, k, float("-inf")).amax(1)
        covered[phys] = True
    return smin, smax, covered


def reference_page_bounds(q: torch.Tensor, summary_min: torch.Tensor, summary_max: torch.Tensor,
                          phys_pages: torch.Tensor, heads_per_selection: int) -> torch.Tensor:
    """float64 Quest bounds ``[S, n]`` of one sequence: q ``[H, D]``, pages ``[n]`` physical ids;
    ``sum over the selection's heads of sum_d max(q_d * min_d, q_d * max_d)``."""
    h = q.shape[0]
    kv_of_head = torch.arange(h, device=q.device) // (h // summary_min.shape[1])
    mn = summary_min[phys_pages].double()[:, kv_of_head]  # [n, H, D]
    mx = summary_max[phys_pages].double()[:, kv_of_head]
    qd = q.double()[None]
    bound = torch.maximum(qd * mn, qd * mx).sum(-1)  # [n, H]
    return bound.view(-1, h // heads_per_selection, heads_per_selection).sum(-1).T


def reference_select_pages(q: torch.Tensor, summary_min: torch.Tensor, summary_max: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, *, sink_pages: int,
                           recent_pages: int, num_pages_budget: int,
                           per_query_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``topk_decode.select_pages``, by sorting float64 bounds (stable: ties go to the
    lower page)."""
    batch, h, _ = q.shape
    hps = 1 if per_query_head else h // summary_min.shape[1]
    n_sel = h // hps
    width = sink_pages + recent_pages + num_pages_budget
    selected = torch.full((batch, n_sel, width), -1, dtype=torch.int32)
    counts = torch.zeros(batch, n_sel, dtype=torch.int32)
    for b in range(batch):
        n_pages = -(-int(seq_lens[b]) // page_size)
        if n_pages == 0:
            continue
        score = reference_page_bounds(q[b], summary_min, summary_max, block_table[b, :n_pages].long(), hps).cpu()
        j = torch.arange(n_pages)
        forced = ((j < sink_pages) | (j >= n_pages - recent_pages)).expand(n_sel, n_pages)
        cand = score.masked_fill(forced, float("-inf"))
        best = cand.argsort(dim=-1, descending=True, stable=True)[:, :num_pages_budget]
        top = torch.zeros_like(forced)
        top.scatter_(1, best, cand.gather(1, best) > float("-inf"))  # short sequences: fewer than the budget
        keep = forced | top
        count = int(keep[0].sum())  # the same for every selection
        selected[b, :, :count] = keep.nonzero()[:, 1].view(n_sel, count).to(torch.int32)
        counts[b] = count
    return selected, counts


def reference_topk_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                    block_table: torch.Tensor, seq_lens: torch.Tensor, selected: torch.Tensor,
                                    counts: torch.Tensor, scale: float, *, topk_tokens: int = 0, sink_pages: int = 0,
                                    recent_pages: int = 0) -> torch.Tensor:
    """float64 ``[batch, H, D]``: same contract as ``topk_decode.topk_decode_attention``, by gathering each
    selection's tokens and a masked softmax (token top-k by ``torch.topk`` on float64 scores).
    Counts must be equal across a sequence's selections (as ``topk_decode.select_pages`` makes them)."""
    batch, h, d = q.shape
    page, hkv = key_cache.shape[1:3]
    n_sel = selected.shape[1]
    hps = h // n_sel
    out = torch.zeros(batch, h, d, dtype=torch.float64)
    sel_kv = torch.arange(n_sel) * hps // (h // hkv)  # KV head of each selection
    for b in range(batch):
        n, count = int(seq_lens[b]), int(counts[b, 0])
        if count == 0:
            continue
        lp = selected[b, :, :count].cpu().long()  # [S, count]
        pos = (lp[..., None] * page + torch.arange(page)).view(n_sel, -1)  # [S, T]
        valid = pos < n
        phys = block_table[b].cpu().long()[pos // page]
        k = key_cache.cpu()[phys, pos % page, sel_kv[:, None]].double()  # [S, T, D]
        v = value_cache.cpu()[phys, pos % page, sel_kv[:, None]].double()
        k = torch.where(valid[..., None], k, 0.0)  # unused slots may be NaN
        v = torch.where(valid[..., None], v, 0.0)
        qs = q[b].cpu().double().view(n_sel, hps, d)
        s = torch.einsum("shd,std->sht", qs, k)
        allowed = valid[:, None, :].expand_as(s)
        if topk_tokens > 0:
            n_pages = -(-n // page)
            forced = ((lp < sink_pages) | (lp >= n_pages - recent_pages)).repeat_interleave(page, -1)[:, None, :]
            cand = s.masked_fill(~allowed | forced, float("-inf"))
            kth = cand.topk(min(topk_tokens, cand.shape[-1]), -1).values[..., -1:]
            allowed = allowed & (forced | (s >= kth))
        p = torch.softmax((s * scale).masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        out[b] = torch.einsum("sht,std->shd", p, v).reshape(h, d)
    return out
