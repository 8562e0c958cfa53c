"""benchmarks/studies/host_kv_feasibility.py: the pure parts behind its tables (issue 54, step 4).

The hot-cache counter against LRU traces followed by hand; the prefill union (the earlier-context
keys a chunk's index lists) against a hand-made index with every kind of entry, and against the
dense mask of a real estimate (``index_to_dense_mask``, the package's independent oracle);
page counting and the fetch-time interpolation against hand-computed values. Torch only.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.studies import host_kv_feasibility as hk
from vllm_sparse_backend.config import SparseSettings
from vllm_sparse_backend.head_configs import resolve_head
from vllm_sparse_backend.prefill.estimate import estimate_index
from vllm_sparse_backend.prefill.index import SparseIndex
from vllm_sparse_kernels.reference.index import index_to_dense_mask


def test_hot_cache_by_hand():
    # capacity 2: [1,2] cold -> cache 1,2; [2,3]: 2 hits, 1 evicted -> 2,3; [1,4]: none -> 1,4;
    # [4,5]: 4 hits -> 4,5
    steps = [[1, 2], [2, 3], [1, 4], [4, 5]]
    st = hk.hot_cache_stats(steps, 2)
    assert st["misses"] == [2, 1, 2, 1]
    assert st["cold"] == 2
    assert st["hit_rate"] == pytest.approx(2 / 6)  # steps 2..4 asked for 6 pages, 2 were there
    assert st["fetched_mean"] == pytest.approx(4 / 3)
    assert st["fetched_max"] == 2
    # capacity 4: 1 survives step 2 ([1,2,3]) and is hit in step 3; 4 is hit in step 4
    st = hk.hot_cache_stats(steps, 4)
    assert st["misses"] == [2, 1, 1, 1]
    assert st["hit_rate"] == pytest.approx(3 / 6)


def test_hot_cache_weights_steps_by_their_pages():
    # a step of 1 page fully hit and a step of 3 pages all missed: 1 / 4, not the mean of 1 and 0
    st = hk.hot_cache_stats([[7], [7], [1, 2, 3]], 8)
    assert st["hit_rate"] == pytest.approx(1 / 4)
    assert st["misses"] == [1, 0, 3]


def test_slice_caches_by_hand():
    # head 0 asks [1], [1], [2]: capacity 1 -> hit, miss; head 1 asks [5, 6], [6, 7], [5]:
    # capacity 1 keeps only the last page of a step -> hit (6), then miss (5)
    steps = [[[1], [5, 6]], [[1], [6, 7]], [[2], [5]]]
    st = hk.slice_cache_stats(steps, 1)
    assert st["misses"] == [3, 1, 2]
    assert st["hit_rate"] == pytest.approx(2 / 5)  # steps 2..3 asked for 5 slices, 2 were cached
    assert st["fetched_mean"] == pytest.approx(3 / 2)


def test_union_steps():
    assert hk.union_steps([[[1, 3], [3, 2]], [[], [5]]]) == [[1, 2, 3], [5]]


def hand_index() -> SparseIndex:
    """block_size 4, a 10-key context, 2 query blocks, 4 heads (KV heads of 2 heads each); the
    lists hold entries past their counts that must be ignored."""
    i32 = torch.int32
    return SparseIndex(
        4,
        block_count=torch.tensor([[1, 1], [0, 0], [0, 0], [1, 0]], dtype=i32),
        # head 0: block 0 (keys 0-3), then block 3 (the chunk's own keys 12-15); head 3: block 2
        # (keys 8-11), its stale second entry (block 1) past the count
        block_index=torch.tensor([[[0, -1], [3, -1]], [[-1, -1], [-1, -1]], [[-1, -1], [-1, -1]],
                                  [[2, 1], [1, 1]]], dtype=i32),
        column_count=torch.tensor([[0, 0], [2, 1], [0, 0], [0, 0]], dtype=i32),
        # head 1: keys 5 and 11 (the chunk's), then key 9
        column_index=torch.tensor([[[-1, -1], [-1, -1]], [[5, 11], [9, 4]], [[-1, -1], [-1, -1]],
                                   [[-1, -1], [-1, -1]]], dtype=i32),
        range_count=torch.tensor([[0, 0], [0, 0], [1, 1], [0, 0]], dtype=i32),
        # head 2: a range at 8 (keys 8-11) and one at 6 (keys 6-9)
        range_start=torch.tensor([[[-1], [-1]], [[-1], [-1]], [[8], [6]], [[-1], [-1]]], dtype=i32),
    )


def test_earlier_key_cover_by_hand():
    cover = hk.earlier_key_cover(hand_index(), ctx_len=10, heads_per_kv=2)
    assert cover.shape == (2, 10)
    assert cover[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 5, 9]
    assert cover[1].nonzero().flatten().tolist() == [6, 7, 8, 9]
    pages, total = hk.page_share(cover, 4)
    assert total == 3 and pages.tolist() == [3, 2]
    pages, total = hk.page_share(cover, 2)  # KV 0: pages 0, 1, 2, 4; KV 1: pages 3, 4
    assert total == 5 and pages.tolist() == [4, 2]
    pages, total = hk.page_share(cover.any(0), 4)
    assert total == 3 and int(pages) == 3


def test_earlier_key_cover_per_query_block_by_hand():
    per = hk.earlier_key_cover(hand_index(), ctx_len=10, heads_per_kv=2, per_query_block=True)
    assert per.shape == (2, 2, 10)
    keys = [[row.nonzero().flatten().tolist() for row in kv] for kv in per]
    assert keys == [[[0, 1, 2, 3, 5], [9]], [[8, 9], [6, 7, 8, 9]]]
    pages, _ = hk.page_share(per, 4)
    assert pages.tolist() == [[2, 1], [1, 2]]


def test_earlier_key_cover_matches_the_dense_mask_of_an_estimate():
    """A real vertical-slash estimate (one selection per KV group) of a chunk after a context:
    the earlier keys any of a group's queries may attend to, from the index's dense mask."""
    gen = torch.Generator().manual_seed(0)
    ctx, q_len, heads, kv_heads, d = 1024, 64, 4, 2, 16
    q = torch.randn(q_len, heads, d, generator=gen)
    k = torch.randn(ctx + q_len, kv_heads, d, generator=gen)
    k[37] *= 4  # a few strong columns, so the selection is not only the band
    k[150] *= 4
    # few diagonals over a long context: many earlier keys are reached by a column alone
    settings = SparseSettings(block_size=16, vertical_size=16, slash_size=4, last_q=16, keep_first_columns=3,
                              keep_last_diagonals=4, min_sparse_query_len=1)
    est = estimate_index(q, k, ctx, [resolve_head(None, settings)] * heads, settings, d ** -0.5)
    mask = index_to_dense_mask(est.index, q_len, ctx)[:, :, :ctx]  # [H, q_len, ctx]
    per_block = mask.view(kv_heads, heads // kv_heads, q_len // 16, 16, ctx).any(3).any(1)
    want = per_block.any(1)
    assert 0 < int(want.sum()) < want.numel()  # neither empty nor everything
    assert torch.equal(hk.earlier_key_cover(est.index, ctx, heads // kv_heads), want)
    assert torch.equal(hk.earlier_key_cover(est.index, ctx, heads // kv_heads, per_query_block=True), per_block)


def test_fetch_ms_for():
    measured = {16: 1.0, 64: 2.0, 256: 5.0}
    assert hk.fetch_ms_for(4, measured) == 1.0  # a fetch's fixed cost
    assert hk.fetch_ms_for(40, measured) == pytest.approx(1.5)
    assert hk.fetch_ms_for(160, measured) == pytest.approx(3.5)
    assert hk.fetch_ms_for(512, measured) == pytest.approx(10.0)


def test_page_bytes():
    assert hk.page_bytes(64, 2, 128) == 64 * 1024  # the 1.5B's 64-token page of one layer
    assert hk.page_bytes(64, 8, 128) == 256 * 1024  # Llama-3-8B's


@pytest.mark.kernels
def test_zero_copy_gather_kernel():
    """The page gather of part 1 copies the listed pages in order, a page longer than one program's
    block included (the last block masked). Triton's interpreter on CPU, the GPU where there is one
    (there reading a pinned pool in place, as the study does)."""
    import triton_setup  # TRITON_INTERPRET before triton; a skip where triton is absent

    on_gpu = triton_setup.CUDA and not triton_setup.INTERPRET
    gen = torch.Generator().manual_seed(0)
    words = 2048 + 100  # two programs per page, the second one mostly masked
    pool = torch.randint(-2**31, 2**31 - 1, (12, words), dtype=torch.int32, generator=gen)
    if on_gpu:
        pool = pool.pin_memory()
    ids = torch.tensor([7, 0, 11, 7, 3])
    dev = "cuda" if on_gpu else "cpu"
    out = torch.zeros(len(ids), words, dtype=torch.int32, device=dev)
    hk.zero_copy_gather(hk._gather_kernel(), pool, ids.to(dev), out)
    assert torch.equal(out.cpu(), pool[ids])
