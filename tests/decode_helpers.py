"""Helpers shared by the Triton decode tests (tests/kernels/test_span_decode.py,
tests/kernels/test_topk_decode.py) and the plugin's decode steps on those kernels
(tests/plugin_triton/test_decode_steps.py): planted span structure, paged caches and block
tables, slots, and the checks of the span selection and persistent flags. Imports the kernel
package only, as the kernel tests do."""

from __future__ import annotations

import torch

from vllm_sparse_kernels.reference import span_decode as span_ref

GARBAGE_PAGE = 10**6  # block-table entries past a sequence's pages: must never be dereferenced


def cdiv(a, b):
    return -(-a // b)


def planted(n, h, hkv, d, gen, page, strength=1.5):
    """q [n, H, D], k/v [n, Hkv, D]: runs of 1-5 pages sharing a random direction; each page and
    each key of a run gets its own share of it, so that neither the sub-intervals of a run (NMS
    candidates) nor its keys (votes) come out nearly tied, where fp32 rounding could order them
    otherwise than the float64 references."""
    q = torch.randn(n, h, d, generator=gen) * 0.3
    k = torch.randn(n, hkv, d, generator=gen) * 0.3
    v = torch.randn(n, hkv, d, generator=gen)
    t = 0
    while t < n:
        length = int(torch.randint(1, 6, (1,), generator=gen)) * page
        base = torch.randn(d, generator=gen) * strength
        q[t:t + length] += base
        m = min(length, n - t)
        page_share = (0.4 + 1.2 * torch.rand(-(-m // page), generator=gen)).repeat_interleave(page)[:m]
        share = page_share * (0.8 + 0.4 * torch.rand(m, generator=gen))
        k[t:t + length] += base * share[:, None, None]
        t += length
    return q, k, v


def slots(table, positions, page):
    positions = torch.as_tensor(positions, dtype=torch.int64)
    return table[0].cpu().to(torch.int64)[positions // page] * page + positions % page


def check_span_selection(sel, counts, q, span_keys, flags, table, seq_lens, page, **widths):
    """The kernel's selection equals the float64 reference's up to ties: pages of one span share
    their key, so where the budget cuts a span any of its pages may be taken."""
    rsel, rcounts = span_ref.reference_select_span_pages(q, span_keys, flags, table, seq_lens, page, **widths)
    assert torch.equal(counts.cpu(), rcounts)
    h, hkv = q.shape[1], span_keys.shape[1]
    group = h // hkv
    for b in range(q.shape[0]):
        phys = table[b].cpu().long()
        for g in range(hkv):
            got = set(sel[b, g, :int(counts[b, g])].tolist())
            want = set(rsel[b, g, :int(rcounts[b, g])].tolist())
            if got == want:
                continue
            qg = q[b, g * group:(g + 1) * group].double().cpu().sum(0)
            score = {j: float(span_keys[phys[j], g].double().cpu() @ qg) for j in got | want}
            cut = min(score[j] for j in want - got)
            for j in got ^ want:
                assert abs(score[j] - cut) <= 1e-5 * max(1.0, abs(cut)), (b, g, j, score[j], cut)
    return rsel, rcounts


def empty_cache(num_pages, page, hkv, d, dtype, layout, device):
    """NaN-filled key and value caches as vLLM views them ([num_pages, page, Hkv, D], non-contiguous)."""
    if layout == "HND":
        kv = torch.full((num_pages, hkv, page, 2 * d), float("nan"), dtype=dtype, device=device)
    else:
        kv = torch.full((num_pages, page, hkv, 2 * d), float("nan"), dtype=dtype, device=device).transpose(1, 2)
    key_cache, value_cache = kv.transpose(1, 2).split(d, -1)
    return key_cache, value_cache


def page_table(seq_lens, page, num_pages, gen, spare=2, shuffle=True):
    """int32 [batch, max pages + spare]: each sequence's pages drawn from a random permutation
    (``shuffle=False``: consecutive physical pages, as a fresh vLLM block pool hands them out)."""
    need = [cdiv(n, page) for n in seq_lens]
    perm = torch.randperm(num_pages, generator=gen) if shuffle else torch.arange(num_pages)
    perm = perm.to(torch.int32)
    table = torch.full((len(seq_lens), max(need) + spare), GARBAGE_PAGE, dtype=torch.int32)
    used = 0
    for i, n_pages in enumerate(need):
        table[i, :n_pages] = perm[used:used + n_pages]
        used += n_pages
    return table


def slots_of(table_row, positions, page):
    positions = torch.as_tensor(positions, dtype=torch.int64)
    return table_row.to(torch.int64)[positions // page] * page + positions % page


def check_flags(flagged, scores, n_pages, sink, recent, persist):
    """``flagged`` are ``persist`` best-scoring pages outside the sink and recent pages. Pages of
    one span share their key, so their scores tie: any of tied pages may be flagged."""
    cand = list(range(sink, n_pages - recent))
    assert len(flagged) == min(persist, len(cand)) and set(flagged) <= set(cand)
    rest = [j for j in cand if j not in flagged]
    if rest and flagged:
        worst = min(float(scores[j]) for j in flagged)
        assert worst >= max(float(scores[j]) for j in rest) - 1e-6 * max(1.0, abs(worst))
