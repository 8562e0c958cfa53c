"""Top-k decode over pages a KV placement keeps (decode/placed.py, issue 54 item 2).

Moving where the pages live must not change the answer: with the host placement (pages in a
host pool, a hot cache smaller than the batch's pages, so that steps evict) the output is the
top-k mode's over vLLM's own cache, bit for bit, while vLLM's cache given to it holds zeros; with
fp8 host pages it is float64 top-k attention over the dequantized pages. Triton's interpreter on
CPU, the kernels themselves on CUDA."""

from __future__ import annotations

import pytest
import torch

from triton_setup import CUDA, INTERPRET, kernel_module

from vllm_sparse_backend.settings import SparseSettings
from vllm_sparse_backend.decode.placed import topk_decode_placed
from vllm_sparse_backend.decode.topk import PageSummaries, TopkDecodeBudget, topk_decode
from vllm_sparse_backend.kv_placement import KVLayout
from vllm_sparse_backend.kv_placement.gpu import GPUPlacement
from vllm_sparse_backend.kv_placement.host import HostPlacement, quantize_pages
from vllm_sparse_kernels.reference import topk_decode as topk_ref

pytestmark = pytest.mark.kernels

DEV = "cuda" if CUDA and not INTERPRET else "cpu"
H, HKV, D, PAGE, BLOCKS, LAYER = 4, 2, 32, 16, 48, 1
BUDGET = TopkDecodeBudget(sink_pages=1, recent_pages=2, budget_pages=2)
SEQ_LENS = [300, 250]  # 19 and 16 pages: more than the 20 hot slots hold over several steps


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(BLOCKS, PAGE, HKV, D, generator=g)
    value_cache = torch.randn(BLOCKS, PAGE, HKV, D, generator=g)
    ids = torch.randperm(BLOCKS, generator=g)  # block ids unrelated to slots or positions
    width = -(-max(SEQ_LENS) // PAGE)
    block_table = torch.zeros(len(SEQ_LENS), width, dtype=torch.int32)
    block_table[0] = ids[:width]
    n1 = -(-SEQ_LENS[1] // PAGE)
    block_table[1, :n1] = ids[width:width + n1]
    return key_cache.to(DEV), value_cache.to(DEV), block_table.to(DEV), torch.tensor(SEQ_LENS, dtype=torch.int32,
                                                                                       device=DEV)


def _summaries(key_cache, block_table, seq_lens):
    summaries = PageSummaries(key_cache, SparseSettings())
    kernel_module("decode.topk_decode").build_page_summaries(key_cache, block_table, seq_lens, summaries.min,
                                                             summaries.max)
    return summaries


def _host_placement(host_kv_dtype="auto"):
    settings = SparseSettings(host_kv_pool_bytes=1 << 24, host_kv_hot_pages=20, host_kv_dtype=host_kv_dtype,
                              decode_sink_pages=BUDGET.sink_pages, decode_recent_pages=BUDGET.recent_pages,
                              decode_budget_pages=BUDGET.budget_pages)
    layout = KVLayout(num_layers=2, num_blocks=BLOCKS, page_size=PAGE, num_kv_heads=HKV, head_size=D,
                      dtype=torch.float32, device=DEV)
    return HostPlacement(settings, layout)


def _queries(step):
    return torch.randn(len(SEQ_LENS), H, D, generator=torch.Generator().manual_seed(100 + step)).to(DEV)


def test_gpu_placement_is_the_topk_mode():
    key_cache, value_cache, block_table, seq_lens = _batch()
    summaries = _summaries(key_cache, block_table, seq_lens)
    q = _queries(0)
    want = topk_decode(q, key_cache, value_cache, summaries, block_table, seq_lens, BUDGET, 0.2, torch.empty_like(q))
    got = torch.empty_like(q)
    topk_decode_placed(q, key_cache, value_cache, summaries, block_table, seq_lens, BUDGET, 0.2, got,
                       placement=GPUPlacement(), layer=LAYER)
    assert torch.equal(got, want)


def test_host_pages_give_the_topk_modes_output_while_steps_evict():
    key_cache, value_cache, block_table, seq_lens = _batch()
    summaries = _summaries(key_cache, block_table, seq_lens)
    placement = _host_placement()
    placement.write(LAYER, list(range(BLOCKS)), key_cache, value_cache)
    empty_k, empty_v = torch.zeros_like(key_cache), torch.zeros_like(value_cache)  # what vLLM's GPU page no longer holds
    for step in range(4):
        q = _queries(step)
        want = topk_decode(q, key_cache, value_cache, summaries, block_table, seq_lens, BUDGET, 0.2,
                           torch.empty_like(q))
        got = torch.empty_like(q)
        residency = topk_decode_placed(q, empty_k, empty_v, summaries, block_table, seq_lens, BUDGET, 0.2, got,
                                       placement=placement, layer=LAYER)
        assert torch.equal(got, want), f"step {step}"
        assert len(residency.slots) == len(set(residency.slots)) <= 20
    assert placement.stats.evictions > 0 and placement.stats.hits > 0  # both paths of the cache ran


def test_a_batch_whose_pages_outnumber_the_hot_slots_runs_in_groups_with_the_topk_modes_output():
    key_cache, value_cache, block_table, seq_lens = _batch(seed=5)
    # four sequences (the two of _batch twice over): up to 7 pages each (sink + recent + 2 KV heads
    # x budget), 28 at once, against 10 hot slots
    block_table, seq_lens = block_table.repeat(2, 1), seq_lens.repeat(2)
    summaries = _summaries(key_cache, block_table, seq_lens)
    settings = SparseSettings(host_kv_pool_bytes=1 << 24, host_kv_hot_pages=10, decode_sink_pages=BUDGET.sink_pages,
                              decode_recent_pages=BUDGET.recent_pages, decode_budget_pages=BUDGET.budget_pages)
    layout = KVLayout(num_layers=2, num_blocks=BLOCKS, page_size=PAGE, num_kv_heads=HKV, head_size=D,
                      dtype=torch.float32, device=DEV)
    placement = HostPlacement(settings, layout)
    placement.write(LAYER, list(range(BLOCKS)), key_cache, value_cache)
    q = torch.randn(4, H, D, generator=torch.Generator().manual_seed(9)).to(DEV)
    want = topk_decode(q, key_cache, value_cache, summaries, block_table, seq_lens, BUDGET, 0.2, torch.empty_like(q))
    got = torch.empty_like(q)
    topk_decode_placed(q, torch.zeros_like(key_cache), torch.zeros_like(value_cache), summaries, block_table,
                       seq_lens, BUDGET, 0.2, got, placement=placement, layer=LAYER)
    assert torch.equal(got, want)
    assert placement.stats.evictions > 0  # the groups took each other's slots


def test_fp8_host_pages_match_float64_topk_attention_over_the_dequantized_pages():
    key_cache, value_cache, block_table, seq_lens = _batch(seed=3)
    placement = _host_placement("fp8_e4m3")
    placement.write(LAYER, list(range(BLOCKS)), key_cache, value_cache)
    (k8, k_scale), (v8, v_scale) = quantize_pages(key_cache.cpu()), quantize_pages(value_cache.cpu())
    key_deq = (k8.double() * k_scale.double()[:, None, :, None]).to(DEV)
    value_deq = (v8.double() * v_scale.double()[:, None, :, None]).to(DEV)
    # the selection is made on summaries of the keys as the model wrote them, in both paths
    summaries = _summaries(key_cache, block_table, seq_lens)
    q = _queries(0)
    got = torch.empty_like(q)
    topk_decode_placed(q, torch.zeros_like(key_cache), torch.zeros_like(value_cache), summaries, block_table,
                       seq_lens, BUDGET, 0.2, got, placement=placement, layer=LAYER)
    selected, counts = topk_ref.reference_select_pages(
        q.double(), summaries.min.double(), summaries.max.double(), block_table, seq_lens, PAGE,
        sink_pages=BUDGET.sink_pages, recent_pages=BUDGET.recent_pages, num_pages_budget=BUDGET.budget_pages)
    want = topk_ref.reference_topk_decode_attention(q.double(), key_deq, value_deq, block_table, seq_lens, selected,
                                                    counts, 0.2)
    # the float64 reference may answer on the host
    torch.testing.assert_close(got.double().cpu(), want.cpu(), atol=2e-5, rtol=2e-5)
    # and fp8 is not a no-op: the pages as written give another answer
    exact = topk_ref.reference_topk_decode_attention(q.double(), key_cache.double(), value_cache.double(),
                                                     block_table, seq_lens, selected, counts, 0.2)
    assert (got.double().cpu() - exact.cpu()).abs().max() > 1e-3


def test_summaries_folded_from_new_keys_are_the_min_and_max_of_each_pages_written_prefix():
    from vllm_sparse_backend.decode.placed import fold_page_summaries
    g = torch.Generator().manual_seed(7)
    page, pages, hkv, d = 4, 12, 2, 8
    smin = torch.randn(pages, hkv, d, generator=g).to(DEV)  # stale content of earlier owners
    smax = smin + 1
    held: dict[int, list[torch.Tensor]] = {}  # the keys each page holds now
    # (block table of a sequence, tokens per call): a prefill chunk, decode steps, then block 5
    # handed to a new sequence, whose first write starts it over
    calls = [([(5, 2, 9), 7], [(0, 11, 6), 5]), ([(5, 2, 9), 1], [(0, 11, 6), 1]), ([(5, 2, 9), 1], [(0, 11, 6), 2]),
             ([(5, 7), 3], [(0, 11, 6), 1])]
    lengths = {}
    for call in calls:
        slots, keys = [], []
        for blocks, n in call:
            start = lengths.get(blocks, 0)
            if blocks == (5, 7):  # the new owner of block 5
                start = lengths.setdefault(blocks, 0)
            for pos in range(start, start + n):
                b = blocks[pos // page]
                k = torch.randn(hkv, d, generator=g)
                if pos % page == 0:
                    held[b] = []
                held[b].append(k)
                slots.append(b * page + pos % page)
                keys.append(k)
            lengths[blocks] = start + n
            slots.append(-1)
            keys.append(torch.tensor([1e6, -1e6]).repeat(hkv, d // 2))  # padding rows carry garbage (to page 0)
        fold_page_summaries(smin, smax, torch.stack(keys).to(DEV), torch.tensor(slots).to(DEV), page)
        for b, ks in held.items():
            torch.testing.assert_close(smin[b].cpu(), torch.stack(ks).amin(0), rtol=0, atol=0)
            torch.testing.assert_close(smax[b].cpu(), torch.stack(ks).amax(0), rtol=0, atol=0)
