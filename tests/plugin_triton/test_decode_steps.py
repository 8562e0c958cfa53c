"""The plugin's decode steps on the Triton decode kernels: top-k page decode
(``vllm_sparse_backend.decode.topk``: summaries followed through a chunked prefill and decode
steps by slot_mapping alone, then selection + attention) and span-retrieval decode
(``vllm_sparse_backend.decode.spans``: its segment planner, two sequences prefilled in chunks in
shared steps with a decode row of a third and padding, then decoded together), and the decode
state the backend lays out against the kernels' allocations.

Moved out of tests/kernels/test_topk_decode.py and test_span_decode.py (issue 52): these exercise
the plugin's code, and the kernel tests import only the kernel package. CPU: Triton's
interpreter at tiny sizes; GPU: realistic sizes. Skipped where triton is missing.
"""

from __future__ import annotations

import pytest
import torch

from triton_setup import CUDA, INTERPRET, kernel_module
from decode_helpers import (GARBAGE_PAGE, cdiv, check_flags, check_span_selection, empty_cache, page_table, planted,
                            slots, slots_of)

from vllm_sparse_kernels.reference import span_decode as span_ref
from vllm_sparse_kernels.reference import topk_decode as topk_ref
from vllm_sparse_kernels.reference.dense import masked_attention_f64

from vllm_sparse_backend.decode.spans import plan_span_segments

pytestmark = pytest.mark.kernels  # `make test` runs these with triton, under its interpreter on CPU

sd = kernel_module("decode.span_decode")
tk = kernel_module("decode.topk_decode")
DEV = "cuda" if CUDA and not INTERPRET else "cpu"
SEG = 256 if INTERPRET else 1024  # the span tests' segment size (tests/kernels/test_span_decode.py's)
cpu_only = pytest.mark.skipif(not INTERPRET, reason="interpreter tests run only with TRITON_INTERPRET=1 (no CUDA)")


def gpu(fn):
    skip = pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA (and TRITON_INTERPRET unset)")
    return pytest.mark.gpu(skip(fn))


# ------------------------------------------------------------------------------------------
# Top-k page decode (vllm_sparse_backend.decode.topk)
# ------------------------------------------------------------------------------------------

def run_decode_steps(prompt_lens, hkv, group, d, page, budget, device, dtype, steps=3, chunk=37, seed=0):
    """Write each prompt in chunks of ``chunk`` tokens, then ``steps`` decode tokens per
    sequence, updating the summaries from each step's slot_mapping only (padding slots -1
    included, as vLLM pads). After every decode step: the summaries equal the float64 ones of the
    cache, and the output equals float64 attention over the pages the float64 selection keeps
    (all pages with a full budget: plain dense decode)."""
    from vllm_sparse_kernels.reference.dense import masked_attention_f64

    from vllm_sparse_backend.decode.topk import PageSummaries, topk_decode

    tk = kernel_module("decode.topk_decode")
    gen = torch.Generator().manual_seed(seed)
    h = hkv * group
    final = [n + steps for n in prompt_lens]
    num_pages = sum(cdiv(n, page) for n in final) + 3
    key_cache, value_cache = empty_cache(num_pages, page, hkv, d, dtype, "NHD", device)
    table = page_table(final, page, num_pages, gen).to(device)
    keys = [torch.randn(n, hkv, d, generator=gen).to(dtype) for n in final]
    vals = [torch.randn(n, hkv, d, generator=gen).to(dtype) for n in final]
    summaries = PageSummaries(key_cache)

    def write(seq, positions):  # vLLM's cache update, then our summaries, from the same slots
        slots = slots_of(table[seq].cpu(), positions, page)
        for p, s in zip(positions, slots.tolist()):
            key_cache[s // page, s % page] = keys[seq][p].to(device)
            value_cache[s // page, s % page] = vals[seq][p].to(device)
        return slots

    for seq, n in enumerate(prompt_lens):
        for start in range(0, n, chunk):
            slots = write(seq, list(range(start, min(n, start + chunk))))
            summaries.update(key_cache, torch.cat([slots, torch.tensor([-1, -1])]).to(device))
    lens = list(prompt_lens)
    for _ in range(steps):
        slots = torch.cat([write(seq, [lens[seq]]) for seq in range(len(lens))])
        lens = [n + 1 for n in lens]
        summaries.update(key_cache, slots.to(device))
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        q = torch.randn(len(lens), h, d, generator=gen).to(dtype).to(device)
        out = torch.full_like(q, float("nan"))
        topk_decode(q, key_cache, value_cache, summaries, table, seq_lens, budget, d ** -0.5, out)

        ref_min, ref_max, covered = topk_ref.reference_page_summaries(key_cache, table, seq_lens)
        assert torch.equal(summaries.min[covered].double(), ref_min[covered])
        assert torch.equal(summaries.max[covered].double(), ref_max[covered])
        selected, counts = topk_ref.reference_select_pages(q, ref_min, ref_max, table, seq_lens, page,
                                                     sink_pages=budget.sink_pages, recent_pages=budget.recent_pages,
                                                     num_pages_budget=budget.budget_pages)
        for b, n in enumerate(lens):
            allowed = torch.zeros(h, 1, n, dtype=torch.bool)
            for kvh in range(hkv):
                pages = selected[b, kvh, :counts[b, kvh]].cpu().long()
                pos = (pages[:, None] * page + torch.arange(page)).flatten()
                allowed[kvh * group:(kvh + 1) * group, 0, pos[pos < n]] = True
            ref = masked_attention_f64(q[b].cpu()[None], keys[b][:n], vals[b][:n], allowed, d ** -0.5)[0]
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            assert (out[b].cpu().double() - ref).abs().max() < tol
    return summaries


@cpu_only
@pytest.mark.parametrize("budget_pages,full", [(2, False), (64, True)])
def test_interp_backend_decode_step(budget_pages, full):
    from vllm_sparse_backend.decode.topk import TopkDecodeBudget

    budget = TopkDecodeBudget(sink_pages=1, recent_pages=1, budget_pages=budget_pages)
    run_decode_steps([5, 70, 130], hkv=2, group=2, d=64, page=16, budget=budget, device="cpu", dtype=torch.float32)


@gpu
def test_gpu_backend_decode_step():
    from vllm_sparse_backend.decode.topk import TopkDecodeBudget

    budget = TopkDecodeBudget(sink_pages=1, recent_pages=4, budget_pages=16)
    run_decode_steps([300, 2100], hkv=8, group=4, d=128, page=16, budget=budget, device="cuda", dtype=torch.bfloat16,
                     chunk=512)


# ------------------------------------------------------------------------------------------
# Span-retrieval decode (vllm_sparse_backend.decode.spans): the planner, then two sequences
# prefilled in chunks in shared steps (with a decode row of a third sequence and padding), then
# decoded together
# ------------------------------------------------------------------------------------------

def test_plan_segments():
    # row 0: decode (skipped); row 1: chunk at positions 10..700 (first full page 1); row 2: 5 tokens
    segs = plan_span_segments([0, 1, 691, 696], [50, 700, 5], 16, 256, 64, "cpu")
    rows = segs.table.tolist()
    assert rows[0] == [1, 1 + 16 - 10, 256, 1, 16]   # tokens 16..271 of row 1 (batch index 7)
    assert rows[1] == [1, 7 + 256, 256, 17, 16]
    assert rows[2] == [1, 7 + 512, 700 - 528, 33, 11]  # last partial page included
    assert rows[3] == [2, 691, 5, 0, 1]
    assert segs.persist_row.tolist() == [1, 2]
    assert segs.persist_tok[0].tolist() == list(range(691 - 64, 691))
    assert segs.persist_weight[1].tolist() == [1.0] * 5 + [0.0] * 59
    assert segs.persist_tok[1, :5].tolist() == list(range(691, 696))
    assert segs.persist_seq_len.tolist() == [700, 5]
    assert len(segs.page_lp) == 16 + 16 + 11 + 1
    assert plan_span_segments([0, 1, 2], [9, 9], 16, 256, 64, "cpu") is None  # decode only


def last_queries_page_mass(q_last, k, page, scale):
    """float64 [pages, Hkv]: the attention mass each page of k ``[n, Hkv, D]`` gets from the last
    queries q_last ``[m, H, D]`` (positions n - m .. n - 1, each its own causal softmax), summed
    over the queries and each KV head's query heads; a loop over queries and heads."""
    m, h, _ = q_last.shape
    n, hkv, _ = k.shape
    mass = torch.zeros(cdiv(n, page), hkv, dtype=torch.float64)
    for i in range(m):
        pos = n - m + i
        for head in range(h):
            g = head // (h // hkv)
            w = torch.softmax(k[:pos + 1, g] @ q_last[i, head] * scale, 0)
            padded = torch.nn.functional.pad(w, (0, cdiv(n, page) * page - pos - 1))
            mass[:, g] += padded.view(-1, page).sum(1)
    return mass


@pytest.mark.parametrize("index, persist, persist_next", [("span", "index", 0), ("page", "index", 0),
                                                          ("span", "attention", 0), ("span", "attention", 1)])
def test_backend_step_prefill_and_decode(index, persist, persist_next):
    """index="span": pages keyed by their span's index keys; "page" (issue 24): by their own
    most-voted key, decode-written pages by their mean key. persist="index": the persistent pages
    are those the last queries score highest by the span keys; "attention" (issue 24): those
    that get the most of the last queries' attention (float64 softmax over the prompt here);
    with persist_next=1 in runs of 2 pages from the persist // 2 most attended ones."""
    from vllm_sparse_backend.settings import SparseSettings
    from vllm_sparse_backend.decode.spans import SpanIndex, plan_step_segments

    page, hkv, group, d = 16, 2, 2, 64
    h = hkv * group
    dtype = torch.float32  # exact maps, as in test_span_keys_through_chunks
    cfg = SparseSettings(decode_mode="spans", decode_sink_pages=1, decode_recent_pages=1, decode_persist_pages=2,
                         decode_budget_pages=3, last_q=16, decode_span_index=index, decode_span_persist=persist,
                         decode_persist_next=persist_next)
    last_q = cfg.patterns.vertical_slash.last_q
    gen = torch.Generator().manual_seed(4)
    prompt = [330, 290, 40]  # sequence 2 is short: already decoding when the others prefill
    chunks = [[0, 200, 330], [0, 170, 290]]
    steps = 3
    final = [n + steps + 2 for n in prompt]  # sequence 2 decodes in the two mixed steps too
    num_pages = sum(cdiv(n, page) for n in final) + 4
    seqs = [planted(n, h, hkv, d, gen, page) for n in final]
    kv = torch.full((num_pages, page, hkv, 2 * d), float("nan"), dtype=dtype, device=DEV)
    key_cache, value_cache = kv.split(d, -1)
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    table = torch.full((3, cdiv(max(final), page) + 2), GARBAGE_PAGE, dtype=torch.int32)
    used = 0
    for i, n in enumerate(final):
        table[i, :cdiv(n, page)] = perm[used:used + cdiv(n, page)]
        used += cdiv(n, page)
    table = table.to(DEV)
    index = SpanIndex(key_cache, cfg)
    params = index.params.__class__(**{**index.params.__dict__, "segment_tokens": SEG})
    object.__setattr__(index, "params", params)

    def write(seq, positions):
        s = slots(table[seq:seq + 1], positions, page)
        q, k, v = seqs[seq]
        key_cache[(s // page).to(DEV), (s % page).to(DEV)] = k[positions].to(dtype).to(DEV)
        value_cache[(s // page).to(DEV), (s % page).to(DEV)] = v[positions].to(dtype).to(DEV)
        return s

    # sequence 2's prompt first (alone), then two mixed steps: its decode row + chunks of 0 and 1
    lens = [0, 0, 0]

    def step(rows):  # rows: [(seq, n_new)] -> runs update + prefill like the backend's forward
        qsl, seq_lens, qs, ks, sl = [0], [], [], [], []
        for seq, n_new in rows:
            pos = list(range(lens[seq], lens[seq] + n_new))
            sl.append(write(seq, pos))
            qs.append(seqs[seq][0][pos])
            ks.append(seqs[seq][1][pos])
            lens[seq] += n_new
            qsl.append(qsl[-1] + n_new)
            seq_lens.append(lens[seq])
        pad = 5
        query = torch.cat(qs + [torch.zeros(pad, h, d)]).to(dtype).to(DEV)
        key = torch.cat(ks + [torch.zeros(pad, hkv, d)]).to(dtype).to(DEV)
        index.update(key_cache, torch.cat(sl + [torch.full((pad,), -1, dtype=torch.int64)]).to(DEV))
        segs = plan_span_segments(qsl, seq_lens, page, SEG, last_q, DEV)  # the tests' segment size
        planned = plan_step_segments(qsl, seq_lens, page, cfg, DEV)  # the backend's (1024-token segments)
        assert planned.persist_row.tolist() == segs.persist_row.tolist()
        if segs is not None:
            step_table = table[[r for r, _ in rows]]
            index.prefill(query, key, key_cache, segs, step_table, d ** -0.5)
        return query

    step([(2, 40)])
    for c in range(2):
        step([(2, 1), (0, chunks[0][c + 1] - chunks[0][c]), (1, chunks[1][c + 1] - chunks[1][c])])
    # span keys of sequences 0 and 1 (chunk boundaries 200 and 170 are inside pages)
    for seq in (0, 1):
        q, k, _ = seqs[seq]
        phys = table[seq, :cdiv(prompt[seq], page)].long()
        got = index.keys[phys].double().cpu()
        want = torch.empty_like(got)
        bounds = chunks[seq]
        for c in range(2):
            start, end = bounds[c], bounds[c + 1]
            p0 = cdiv(start, page)
            ref, _ = span_ref.reference_span_keys(q[p0 * page:end].to(dtype), k[p0 * page:end].to(dtype), page,
                                            d ** -0.5, params)
            want[p0:p0 + ref.shape[0]] = ref
            if start % page:
                a = start // page
                want[a] = params.fallback_count * k[a * page:(a + 1) * page].to(dtype).double().mean(0)
        tol = 1e-4 if INTERPRET else 2e-2
        assert torch.allclose(got, want, rtol=tol, atol=tol), (seq, (got - want).abs().max())
        q_last = q[prompt[seq] - last_q:prompt[seq]].to(dtype).double()
        n_pages = cdiv(prompt[seq], page)
        mass = last_queries_page_mass(q_last, k[:prompt[seq]].to(dtype).double(), page, d ** -0.5)
        for g in range(hkv):
            flagged = [j for j in range(n_pages) if index.flags[phys[j], g]]
            by_index = got[:, g] @ q_last.sum(0)[g * group:(g + 1) * group].sum(0)
            score = mass[:, g] if persist == "attention" else by_index
            if persist_next:  # the one best page outside sink (page 0) and recent (the last) + the next
                best = 1 + int(mass[1:n_pages - 1, g].argmax())
                assert flagged == [j for j in (best, best + 1) if j < n_pages - 1]
            else:
                check_flags(flagged, score, n_pages, 1, 1, 2)
    # decode steps of all three sequences: equal to float64 attention over the reference selection
    for _ in range(steps):
        sl = torch.cat([write(s, [lens[s]]) for s in range(3)])
        lens = [n + 1 for n in lens]
        index.update(key_cache, sl.to(DEV))
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        qd = torch.stack([seqs[s][0][lens[s] - 1] for s in range(3)]).to(dtype).to(DEV)
        out = torch.full_like(qd, float("nan"))
        index.decode(qd, key_cache, value_cache, table, seq_lens, d ** -0.5, out)
        b = index.budget
        sel, counts = sd.select_span_pages(qd, index.keys, index.flags, table, seq_lens, page,
                                           sink_pages=b.sink_pages, recent_pages=b.recent_pages,
                                           persist_pages=b.persist_pages, num_pages_budget=b.budget_pages)
        check_span_selection(sel, counts, qd, index.keys, index.flags, table, seq_lens, page, sink_pages=1,
                        recent_pages=1, persist_pages=2, num_pages_budget=3)
        sel, counts = sel.cpu(), counts.cpu()
        for b, n in enumerate(lens):
            allowed = torch.zeros(h, 1, n, dtype=torch.bool)
            for g in range(hkv):
                pages = sel[b, g, :counts[b, g]].long()
                pos = (pages[:, None] * page + torch.arange(page)).flatten()
                allowed[g * group:(g + 1) * group, 0, pos[pos < n]] = True
            _, k, v = seqs[b]
            ref = masked_attention_f64(qd[b].cpu()[None], k[:n].to(dtype), v[:n].to(dtype), allowed, d ** -0.5)[0]
            tol = 1e-4 if INTERPRET else 2e-2
            assert (out[b].cpu().double() - ref).abs().max() < tol
        assert int(counts[0, 0]) == 1 + 1 + 2 + 3  # the 21-page sequence: the full width


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_plugins_state_layouts_are_the_kernels_allocations(dtype):
    """The backend reserves and lays out the decode state from its own layouts
    (vllm_sparse_backend.decode.{topk,spans}); the kernels' allocation functions are the state the
    kernels were written for: the same tensors."""
    from vllm_sparse_backend.decode.spans import span_index_layout
    from vllm_sparse_backend.decode.topk import summaries_layout

    key_cache = torch.zeros(9, 16, 2, 64, dtype=dtype)
    num_pages, _, hkv, d = key_cache.shape
    for layout, tensors in ((summaries_layout(num_pages, hkv, d, dtype), tk.allocate_page_summaries(key_cache)),
                            (span_index_layout(num_pages, hkv, d), sd.allocate_span_index(key_cache))):
        assert [(tuple(t.shape), t.dtype) for t in tensors] == [(tuple(s), t) for s, t in layout]
