"""Top-k decode kernels (vllm_sparse_kernels/decode/topk_decode.py) vs independent torch references.

CPU: Triton's interpreter (TRITON_INTERPRET=1) at tiny sizes when triton is importable. GPU:
realistic sizes, bf16. Caches are paged with the sequences' pages in random physical order and
NaN in every unused slot (the tail of each last page and the pages of no sequence), block-table
entries past a sequence's pages hold garbage, and outputs are poisoned with NaN first:

(a) summaries equal min / max over the valid keys, taken from the keys as generated (not from
    the cache), after a build and after incremental updates (prefill chunks, then decode steps);
(b) the selection equals the module's float64 reference (inputs have no ties), always holds the
    sink and recent pages, and the Quest bound really bounds every token's score;
(c) attention equals float64 attention (reference/dense.py) restricted to the selected pages'
    tokens, or to the per-head top-k tokens; with a budget covering every page it equals full
    dense decode attention;
(d) batches of sequences of different lengths, pages of 16 and 32, GQA groups 1/4/7/8, head
    dims 64/128, NHD and HND layouts.

Without CUDA this module sets TRITON_INTERPRET=1 for the whole pytest process (triton_setup).
"""

from __future__ import annotations

import math

import pytest
import torch

from triton_setup import CUDA, INTERPRET, kernel_module
from decode_helpers import cdiv, empty_cache, page_table, slots_of

from vllm_sparse_kernels.reference import topk_decode as topk_ref
from vllm_sparse_kernels.reference.dense import masked_attention_f64

pytestmark = pytest.mark.kernels  # `make test` runs these with triton, under its interpreter on CPU

tk = kernel_module("decode.topk_decode")
DEV = "cuda" if CUDA and not INTERPRET else "cpu"

cpu_only = pytest.mark.skipif(not INTERPRET, reason="interpreter tests run only with TRITON_INTERPRET=1 (no CUDA)")


def gpu(fn):
    skip = pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA (and TRITON_INTERPRET unset)")
    return pytest.mark.gpu(skip(fn))


# ------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------

def make_cache(seq_lens, hkv, d, page, dtype, gen, device, layout="NHD"):
    """Paged K/V holding random keys for every sequence: (key_cache, value_cache, block_table,
    keys, values), keys / values the per-sequence [n, Hkv, D] tensors as generated (CPU)."""
    num_pages = sum(cdiv(n, page) for n in seq_lens) + 3
    key_cache, value_cache = empty_cache(num_pages, page, hkv, d, dtype, layout, device)
    table = page_table(seq_lens, page, num_pages, gen)
    keys, values = [], []
    for i, n in enumerate(seq_lens):
        k = torch.randn(n, hkv, d, generator=gen).to(dtype)
        v = torch.randn(n, hkv, d, generator=gen).to(dtype)
        slots = slots_of(table[i], range(n), page)
        key_cache[slots // page, slots % page] = k.to(device)
        value_cache[slots // page, slots % page] = v.to(device)
        keys.append(k)
        values.append(v)
    return key_cache, value_cache, table.to(device), keys, values


def expected_summaries(keys, table, page, filled):
    """{physical page: (min [Hkv, D], max [Hkv, D])} over the first ``filled[i]`` keys of each
    sequence, computed from the generated keys."""
    want = {}
    for i, k in enumerate(keys):
        for j in range(cdiv(filled[i], page)):
            chunk = k[j * page:min(filled[i], (j + 1) * page)].double()
            want[int(table[i, j])] = (chunk.amin(0), chunk.amax(0))
    return want


def check_summaries(summary_min, summary_max, want, sentinel):
    smin, smax = summary_min.double().cpu(), summary_max.double().cpu()
    for p, (mn, mx) in want.items():
        assert torch.equal(smin[p], mn) and torch.equal(smax[p], mx), f"page {p}"
    untouched = torch.ones(smin.shape[0], dtype=torch.bool)
    untouched[list(want)] = False
    assert (smin[untouched] == sentinel).all() and (smax[untouched] == sentinel).all(), "wrote a page of no sequence"


# ------------------------------------------------------------------------------------------
# (a) summaries
# ------------------------------------------------------------------------------------------

def run_build_case(seq_lens, hkv, d, page, dtype, summary_dtype, seed, layout="NHD", device=DEV):
    gen = torch.Generator().manual_seed(seed)
    key_cache, _, table, keys, _ = make_cache(seq_lens, hkv, d, page, dtype, gen, device, layout)
    smin, smax = tk.allocate_page_summaries(key_cache, summary_dtype)
    smin.fill_(7.0)
    smax.fill_(7.0)
    tk.build_page_summaries(key_cache, table, torch.tensor(seq_lens, dtype=torch.int32, device=device), smin, smax)
    check_summaries(smin, smax, expected_summaries(keys, table.cpu(), page, seq_lens), 7.0)
    # the module's reference (used by other checks) agrees
    rmin, rmax, covered = topk_ref.reference_page_summaries(key_cache, table, torch.tensor(seq_lens))
    assert torch.equal(rmin[covered].cpu(), smin[covered].double().cpu())
    assert torch.equal(rmax[covered].cpu(), smax[covered].double().cpu())


def run_update_case(seq_lens, hkv, d, page, dtype, summary_dtype, seed, decode_steps=3, shuffle=True, device=DEV):
    """Sequences grow by prefill chunks of random sizes, then by one token per decode step, all
    in one slot_mapping per step (sequences in random order, -1 padding at the end); after every
    step each page's summary covers exactly its filled prefix."""
    gen = torch.Generator().manual_seed(seed)
    final = [n + decode_steps for n in seq_lens]
    num_pages = sum(cdiv(n, page) for n in final) + 3
    key_cache, _ = empty_cache(num_pages, page, hkv, d, dtype, "NHD", device)
    table = page_table(final, page, num_pages, gen, shuffle=shuffle)
    keys = [torch.randn(n, hkv, d, generator=gen).to(dtype) for n in final]
    smin, smax = tk.allocate_page_summaries(key_cache, summary_dtype)
    smin.fill_(7.0)
    smax.fill_(7.0)
    filled = [0] * len(final)
    while filled != final:
        slots, order = [], torch.randperm(len(final), generator=gen).tolist()
        for i in order:
            if filled[i] == final[i]:
                continue
            if filled[i] < seq_lens[i]:
                step = min(int(torch.randint(1, 40, (1,), generator=gen)), seq_lens[i] - filled[i])
            else:
                step = 1
            s = slots_of(table[i], range(filled[i], filled[i] + step), page)
            key_cache[s // page, s % page] = keys[i][filled[i]:filled[i] + step].to(device)
            slots.append(s)
            filled[i] += step
        slots.append(torch.full((3,), -1, dtype=torch.int64))
        tk.update_page_summaries(key_cache, smin, smax, torch.cat(slots).to(device))
        check_summaries(smin, smax, expected_summaries(keys, table, page, filled), 7.0)


@cpu_only
@pytest.mark.parametrize("page,dtype,summary_dtype,layout", [
    (16, torch.float32, torch.float32, "NHD"), (32, torch.bfloat16, torch.bfloat16, "HND"),
    (16, torch.float16, torch.float32, "HND")])
def test_interp_build_summaries(page, dtype, summary_dtype, layout):
    run_build_case([1, 16, 23, 70], 2, 64, page, dtype, summary_dtype, seed=page, layout=layout)


@cpu_only
@pytest.mark.parametrize("page,d,dtype,shuffle", [(16, 64, torch.bfloat16, True), (32, 128, torch.float32, True),
                                                  (16, 64, torch.float32, False)])
def test_interp_update_summaries(page, d, dtype, shuffle):
    # shuffle=False: a full page's last slot is followed by slot + 1 (the next physical page)
    run_update_case([5, 33, 64], 2, d, page, dtype, dtype, seed=d + page, shuffle=shuffle)


def test_bad_inputs_are_refused():
    key_cache = torch.zeros(4, 12, 2, 64)
    with pytest.raises(ValueError, match="power of two"):
        tk.build_page_summaries(key_cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                torch.zeros(4, 2, 64), torch.zeros(4, 2, 64))
    key_cache = torch.zeros(4, 16, 2, 64)
    with pytest.raises(ValueError, match="summaries"):
        tk.update_page_summaries(key_cache, torch.zeros(4, 2, 32), torch.zeros(4, 2, 32),
                                 torch.zeros(1, dtype=torch.int64))


# ------------------------------------------------------------------------------------------
# (b) selection
# ------------------------------------------------------------------------------------------

def check_selection(selected, counts, seq_lens, page, sink, recent, budget):
    """Format and the always-kept pages, independent of scores."""
    selected, counts = selected.cpu(), counts.cpu()
    width = sink + recent + budget
    assert selected.dtype == torch.int32 and selected.shape[-1] == width
    for b, n in enumerate(seq_lens):
        n_pages = cdiv(n, page)
        assert (counts[b] == min(n_pages, width)).all()
        for row, c in zip(selected[b], counts[b]):
            ids = row[:c].tolist()
            assert ids == sorted(set(ids)) and all(0 <= j < n_pages for j in ids)
            assert (row[c:] == -1).all()
            forced = set(range(min(sink, n_pages))) | set(range(max(0, n_pages - recent), n_pages))
            assert forced <= set(ids), f"sequence {b}: sink/recent pages {forced} missing from {ids}"


def run_select_case(seq_lens, hkv, group, d, page, dtype, seed, sink=1, recent=2, budget=3, per_query_head=False,
                    device=DEV, max_pages=None):
    gen = torch.Generator().manual_seed(seed)
    key_cache, _, table, _, _ = make_cache(seq_lens, hkv, d, page, dtype, gen, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    smin, smax = tk.allocate_page_summaries(key_cache)
    tk.build_page_summaries(key_cache, table, lens, smin, smax)
    q = torch.randn(len(seq_lens), hkv * group, d, generator=gen).to(dtype).to(device)
    kw = dict(sink_pages=sink, recent_pages=recent, num_pages_budget=budget, per_query_head=per_query_head)
    sel, cnt = tk.select_pages(q, smin, smax, table, lens, page, max_pages=max_pages, **kw)
    check_selection(sel, cnt, seq_lens, page, sink, recent, budget)
    ref_sel, ref_cnt = topk_ref.reference_select_pages(q, smin, smax, table, lens, page, **kw)
    assert torch.equal(cnt.cpu(), ref_cnt)
    if not torch.equal(sel.cpu(), ref_sel):
        # a tie between pages may be broken either way: then the chosen bounds must agree
        hps = 1 if per_query_head else group
        for b, n in enumerate(seq_lens):
            phys = table[b, :cdiv(n, page)].long()
            bound = topk_ref.reference_page_bounds(q[b], smin, smax, phys, hps).cpu()
            for s in range(sel.shape[1]):
                c = int(cnt[b, s])
                got = bound[s, sel[b, s, :c].long().cpu()].sort().values
                want = bound[s, ref_sel[b, s, :c].long()].sort().values
                assert torch.allclose(got, want, rtol=1e-5), f"sequence {b}, selection {s}"
    return sel, cnt


@cpu_only
@pytest.mark.parametrize("group,d,page,per_query_head", [(1, 64, 16, False), (4, 128, 32, False), (7, 64, 16, False),
                                                        (8, 64, 16, True), (4, 128, 16, True)])
def test_interp_select_pages(group, d, page, per_query_head):
    # 1 token (one page), a short sequence whose pages are all sink/recent, a partly full last page
    run_select_case([1, 40, 150, 333], 2, group, d, page, torch.bfloat16, seed=group * 10 + d + page,
                    per_query_head=per_query_head)


@cpu_only
def test_interp_select_pages_edges():
    # no sinks or no recent pages, budget larger than the candidates, max_pages below the table width
    run_select_case([100, 260], 1, 4, 64, 16, torch.float32, seed=1, sink=0, recent=1, budget=4)
    run_select_case([100, 260], 1, 4, 64, 16, torch.float32, seed=2, sink=2, recent=0, budget=20)
    run_select_case([100, 260], 1, 4, 64, 16, torch.float32, seed=3, max_pages=17)


@cpu_only
def test_interp_select_pages_empty_sequence():
    # a padded batch slot (seq_len 0) selects nothing
    sel, cnt = run_select_case([0, 50], 1, 4, 64, 16, torch.float32, seed=4)
    assert (cnt[0] == 0).all() and (sel[0] == -1).all()


def test_quest_bound_bounds_every_score():
    # the reference bound (what the selection ranks by) is >= every key's score in the page
    gen = torch.Generator().manual_seed(0)
    seq_lens, page, hkv, group, d = [37, 80], 16, 2, 4, 64
    key_cache, _, table, keys, _ = make_cache(seq_lens, hkv, d, page, torch.float32, gen, "cpu")
    smin, smax, _ = topk_ref.reference_page_summaries(key_cache, table, torch.tensor(seq_lens))
    for b, n in enumerate(seq_lens):
        q = torch.randn(hkv * group, d, generator=gen)
        bound = topk_ref.reference_page_bounds(q, smin, smax, table[b, :cdiv(n, page)].long(), 1)  # [H, pages]
        scores = torch.einsum("hd,nhd->hn", q.double(), keys[b].double().repeat_interleave(group, 1))
        per_page = torch.nn.functional.pad(scores, (0, cdiv(n, page) * page - n), value=-math.inf)
        assert (bound + 1e-9 >= per_page.view(hkv * group, -1, page).amax(-1)).all()


# ------------------------------------------------------------------------------------------
# (c) attention
# ------------------------------------------------------------------------------------------

def selection_mask(selected, counts, n, page, h):
    """bool [H, 1, n]: the keys of the pages each query head's selection holds."""
    hps = h // selected.shape[0]
    mask = torch.zeros(h, 1, n, dtype=torch.bool)
    for s in range(selected.shape[0]):
        for j in selected[s, :int(counts[s])].tolist():
            mask[s * hps:(s + 1) * hps, 0, j * page:min(n, (j + 1) * page)] = True
    return mask


def token_topk_mask(q, k, mask, n, page, topk, sink, recent):
    """Restrict ``mask`` [H, 1, n] to, per head, the ``topk`` best float64 scores among the keys
    outside the sink / recent pages; keys of those pages stay. Also returns bool [H]: the heads
    whose k-th and (k+1)-th scores are clearly apart (elsewhere the kernel's fp32 scores may
    legitimately pick the other key of a near tie, so those heads are not compared)."""
    h, hkv = q.shape[0], k.shape[1]
    s = torch.einsum("hd,nhd->hn", q.double(), k.double().repeat_interleave(h // hkv, 1))[:, None, :]
    page_of = torch.arange(n) // page
    forced = (page_of < sink) | (page_of >= cdiv(n, page) - recent)
    cand = s.masked_fill(~mask | forced, -math.inf)
    kk = min(topk, n)
    top = cand.topk(kk, -1).values
    clear = torch.ones(h, dtype=torch.bool)
    if kk < n:
        nxt = cand.topk(kk + 1, -1).values[..., -1]
        gap = top[..., -1] - nxt
        clear = ~(torch.isfinite(top[..., -1]) & (gap < 1e-3))[:, 0]
    return mask & (forced | (s >= top[..., -1:])), clear


def run_attention_case(seq_lens, hkv, group, d, page, dtype, seed, *, sink=1, recent=2, budget=3, topk_tokens=0,
                       per_query_head=False, num_splits=None, layout="NHD", full=False, tol=None, device=DEV):
    gen = torch.Generator().manual_seed(seed)
    h = hkv * group
    key_cache, value_cache, table, keys, values = make_cache(seq_lens, hkv, d, page, dtype, gen, device, layout)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    smin, smax = tk.allocate_page_summaries(key_cache)
    tk.build_page_summaries(key_cache, table, lens, smin, smax)
    q = torch.randn(len(seq_lens), h, d, generator=gen).to(dtype).to(device)
    if full:
        budget = max(cdiv(n, page) for n in seq_lens)
    sel, cnt = tk.select_pages(q, smin, smax, table, lens, page, sink_pages=sink, recent_pages=recent,
                               num_pages_budget=budget, per_query_head=per_query_head)
    scale = 1.0 / math.sqrt(d)
    out = torch.full_like(q, float("nan"))
    tk.topk_decode_attention(q, key_cache, value_cache, table, lens, sel, cnt, scale, out, topk_tokens=topk_tokens,
                             sink_pages=sink, recent_pages=recent, num_splits=num_splits)
    if tol is None:
        tol = 1e-4 if dtype == torch.float32 and device == "cpu" else (3e-3 if dtype == torch.float32 else 1e-2)
    sel, cnt, out, qc = sel.cpu(), cnt.cpu(), out.cpu(), q.cpu()
    compared = torch.ones(len(seq_lens), h, dtype=torch.bool)  # (sequence, head) outputs without near ties
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert (out[b] == 0).all(), "nothing selected must give zeros"
            continue
        mask = torch.ones(h, 1, n, dtype=torch.bool) if full else selection_mask(sel[b], cnt[b], n, page, h)
        clear = torch.ones(h, dtype=torch.bool)
        if topk_tokens:
            mask, clear = token_topk_mask(qc[b], keys[b], mask, n, page, topk_tokens, sink, recent)
            assert clear.sum() >= h / 2, f"sequence {b}: most heads have near ties at the k-th score: change seed"
            compared[b] = clear
        ref = masked_attention_f64(qc[b][None], keys[b], values[b], mask.expand(h, 1, n), scale)[0][clear]
        got = out[b].double()[clear]
        assert not torch.isnan(got).any(), f"sequence {b}: NaN in the output"
        err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert err < tol, f"sequence {b} (n={n}): rel err {err:.3e} >= {tol}"
    if not full and len(seq_lens) <= 8:
        # the module's reference agrees with the independent one above
        ref_all = topk_ref.reference_topk_decode_attention(q, key_cache, value_cache, table, lens, sel, cnt, scale,
                                                     topk_tokens=topk_tokens, sink_pages=sink, recent_pages=recent)
        got, ref_all = out.double()[compared], ref_all.cpu()[compared]
        err = ((got - ref_all).norm() / ref_all.norm()).item()
        assert err < tol, f"vs reference_topk_decode_attention: {err:.3e}"


SMALL = [1, 23, 70, 161]  # tokens per sequence: one token, partly full last pages, none a multiple of 16


@cpu_only
@pytest.mark.parametrize("group,d,page,dtype,layout", [
    (1, 64, 16, torch.float32, "NHD"), (4, 128, 32, torch.bfloat16, "HND"), (7, 64, 16, torch.float16, "NHD"),
    (8, 128, 16, torch.bfloat16, "NHD"), (4, 64, 32, torch.float32, "HND")])
def test_interp_attention_selected_pages(group, d, page, dtype, layout):
    run_attention_case(SMALL, 2 if group < 7 else 1, group, d, page, dtype, seed=group + d + page, layout=layout)


@cpu_only
@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_interp_attention_splits(num_splits):
    # splits share out the selected pages; more splits than tiles leaves some empty
    run_attention_case(SMALL, 1, 4, 64, 16, torch.float32, seed=3, budget=6, num_splits=num_splits)


@cpu_only
@pytest.mark.parametrize("group,page", [(4, 16), (7, 32)])
def test_interp_attention_per_query_head(group, page):
    run_attention_case(SMALL, 1, group, 64, page, torch.bfloat16, seed=5 + group, per_query_head=True, num_splits=2)


@cpu_only
@pytest.mark.parametrize("group,d,page,dtype", [(1, 64, 16, torch.float32), (8, 128, 32, torch.bfloat16)])
def test_interp_full_budget_is_dense_decode(group, d, page, dtype):
    run_attention_case(SMALL, 1, group, d, page, dtype, seed=11, full=True, num_splits=3)


@cpu_only
@pytest.mark.parametrize("group,page,per_query_head,num_splits", [(4, 16, False, 1), (7, 16, True, 3),
                                                                  (1, 32, False, 2)])
def test_interp_token_topk(group, page, per_query_head, num_splits):
    # 12 keys per head among the budget pages (fewer candidates than that in the short sequences)
    run_attention_case(SMALL, 1, group, 64, page, torch.float32, seed=21 + group, budget=4, topk_tokens=12,
                       per_query_head=per_query_head, num_splits=num_splits)


@cpu_only
def test_interp_token_topk_bf16_and_empty_sequence():
    run_attention_case([0, 45, 150], 2, 4, 128, 16, torch.bfloat16, seed=8, budget=3, topk_tokens=9, num_splits=2)
    run_attention_case([0, 45, 150], 2, 4, 128, 16, torch.bfloat16, seed=8, budget=3)


# ------------------------------------------------------------------------------------------
# GPU, realistic sizes
# ------------------------------------------------------------------------------------------

BIG = [1, 700, 5000, 20011]


@gpu
@pytest.mark.parametrize("page,dtype", [(16, torch.bfloat16), (32, torch.float16)])
def test_gpu_summaries(page, dtype):
    run_build_case(BIG, 8, 128, page, dtype, dtype, seed=page, layout="HND")
    run_update_case([300, 1000, 33], 8, 128, page, dtype, dtype, seed=page, decode_steps=5)
    run_update_case([300, 1000, 33], 8, 128, page, dtype, dtype, seed=page, decode_steps=5, shuffle=False)


@gpu
@pytest.mark.parametrize("group,d,page", [(4, 128, 16), (7, 64, 32), (8, 128, 16), (1, 64, 16)])
def test_gpu_select_pages(group, d, page):
    run_select_case(BIG, 2, group, d, page, torch.bfloat16, seed=group + d, sink=1, recent=4, budget=64)
    run_select_case(BIG, 2, group, d, page, torch.bfloat16, seed=group + d, sink=1, recent=4, budget=64,
                    per_query_head=True)


@gpu
@pytest.mark.parametrize("group,d,page,dtype", [(4, 128, 16, torch.bfloat16), (7, 64, 32, torch.bfloat16),
                                                (8, 128, 16, torch.float16), (1, 64, 16, torch.bfloat16)])
def test_gpu_attention(group, d, page, dtype):
    run_attention_case(BIG, 2, group, d, page, dtype, seed=group + d, sink=1, recent=4, budget=64)
    run_attention_case(BIG, 2, group, d, page, dtype, seed=group + d, sink=1, recent=4, budget=64, num_splits=1,
                       per_query_head=True)
    run_attention_case(BIG, 2, group, d, page, dtype, seed=group + d, sink=1, recent=4, budget=64, topk_tokens=256)


@gpu
def test_gpu_full_budget_is_dense_decode():
    run_attention_case(BIG, 2, 4, 128, 16, torch.bfloat16, seed=1, full=True)
