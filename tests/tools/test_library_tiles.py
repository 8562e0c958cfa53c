"""benchmarks/studies/library_tiles.py: the block-mask conversions that feed our kernel, FlashInfer's
block-sparse prefill and FlashAttention-4's block sparsity, each checked at the token level against
the dense mask of the block mask built here by loops, and our kernel on the refined mask against
float64 attention.

The references are written independently of the module: the (query, key) pairs of a block mask
(blocks expanded one by one, then causality); what FlashInfer's causal BSR prefill computes from
page lists (each query block attends to the concatenation of its pages' keys, causal aligned to
the bottom right, pages mapped back to key positions through the block table); what FA4 computes
from its "mask" / "full" lists (the listed blocks of each query head, causality applied). The
conversion tests are torch only and run in the main suite; the kernel test is marked ``kernels``
(Triton's interpreter on CPU, skipped where triton is absent).
"""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.studies import library_tiles as lt
from vllm_sparse_kernels.reference.dense import masked_attention_f64
from vllm_sparse_kernels.reference.index import index_to_dense_mask

N = 768  # six 128-query blocks, twelve 64-query blocks


def token_pairs(mask: torch.Tensor, block: tuple[int, int], n: int) -> torch.Tensor:
    """bool [L, n, n]: the (query, key) pairs of a block mask, causality applied (block by block)."""
    bq, bk = block
    out = torch.zeros(mask.shape[0], n, n, dtype=torch.bool)
    for li, qb, kb in mask.nonzero().tolist():
        out[li, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk] = True
    pos = torch.arange(n)
    return out & (pos[None, :] <= pos[:, None])


def flashinfer_pairs(indptr, indices, rows: int, page: int, table_row, n: int) -> torch.Tensor:
    """bool [n, n]: FlashInfer's causal BSR prefill over pages: query block r attends to its
    listed pages' keys in list order, query i of the block to the first kv_len - rows + i + 1."""
    where = {int(p): j for j, p in enumerate(table_row.tolist())}  # physical page -> logical page
    out = torch.zeros(n, n, dtype=torch.bool)
    for r in range(len(indptr) - 1):
        keys = [where[int(p)] * page + t for p in indices[int(indptr[r]):int(indptr[r + 1])] for t in range(page)]
        for i in range(rows):
            for j, key in enumerate(keys):
                if j <= len(keys) - rows + i:
                    out[r * rows + i, key] = True
    return out


def fa4_listed(cnt: torch.Tensor, idx: torch.Tensor, nk: int) -> torch.Tensor:
    """bool [H, M, nk] of one FA4 list pair ([1, H, M] counts, [1, H, M, W] indices)."""
    h, m = cnt.shape[1:]
    out = torch.zeros(h, m, nk, dtype=torch.bool)
    for head in range(h):
        for mb in range(m):
            for j in range(int(cnt[0, head, mb])):
                out[head, mb, int(idx[0, head, mb, j])] = True
    return out


def kv_mask(hkv: int, density: float, seed: int) -> torch.Tensor:
    return lt.random_block_mask(hkv, N, 128, density, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("density", [0.05, 0.3, 0.7, 1.0])
def test_random_block_mask(density):
    m = N // 128
    mask = kv_mask(3, density, seed=1)
    assert mask.shape == (3, m, m) and mask.dtype == torch.bool
    assert not mask.triu(1).any(), "a block above the diagonal"
    assert mask.diagonal(dim1=1, dim2=2).all(), "a diagonal block missing"
    want = torch.tensor([max(1, round(density * (qb + 1))) for qb in range(m)])
    assert torch.equal(mask.sum(-1), want.expand(3, m))
    assert torch.equal(mask, kv_mask(3, density, seed=1)), "not reproducible from its seed"
    if 0.05 < density < 1.0:
        assert not torch.equal(mask[0], mask[1]), "the KV heads' masks should differ"


@pytest.mark.parametrize("fine", [(64, 64), (128, 64), (64, 128)])
@pytest.mark.parametrize("seed", [0, 1])
def test_refine_keeps_the_pairs_and_coarsens_back(fine, seed):
    mask = kv_mask(2, 0.4, seed)
    ref = token_pairs(mask, lt.FA4_BLOCK, N)
    refined = lt.refine_block_mask(mask, lt.FA4_BLOCK, fine)
    assert refined.shape == (2, N // fine[0], N // fine[1])
    assert torch.equal(token_pairs(refined, fine, N), ref)
    # no listed block holds only keys after all its queries (FlashInfer's causal alignment needs this)
    q_last = torch.arange(N // fine[0])[:, None] * fine[0] + fine[0] - 1
    assert not (refined & (torch.arange(N // fine[1])[None, :] * fine[1] > q_last)).any()
    assert torch.equal(lt.coarsen_block_mask(refined, fine, lt.FA4_BLOCK), mask)
    assert lt.representable(refined, fine, lt.FA4_BLOCK)


def test_a_lone_64_block_is_not_representable_at_128():
    mask = torch.zeros(1, N // 64, N // 64, dtype=torch.bool)
    mask[0].diagonal().fill_(True)
    assert lt.representable(mask, (64, 64), (128, 128)) is False  # the diagonal 128 block also holds (1, 0)
    mask[0, 1::2, 0::2] |= torch.eye(N // 128, dtype=torch.bool)
    assert lt.representable(mask, (64, 64), (128, 128))
    mask[0, 5, 0] = True  # one 64 block of a 128 block whose other three are absent
    assert not lt.representable(mask, (64, 64), (128, 128))


def test_bsr_lists_ascending_rows():
    mask = kv_mask(1, 0.5, seed=3)[0]
    indptr, indices = lt.block_mask_to_bsr(mask)
    assert indptr.dtype == indices.dtype == torch.int32
    assert indptr[0] == 0 and indptr[-1] == mask.sum() and len(indptr) == mask.shape[0] + 1
    for r in range(mask.shape[0]):
        row = indices[indptr[r]:indptr[r + 1]].tolist()
        assert row == sorted(row) and row == mask[r].nonzero()[:, 0].tolist()


@pytest.mark.parametrize("rows,page", [(64, 64), (64, 16), (128, 64), (128, 16), (64, 32)])
@pytest.mark.parametrize("seed", [0, 1])
def test_flashinfer_page_lists_compute_the_mask(rows, page, seed):
    """The BSR over physical pages, read with FlashInfer's bottom-right causal alignment per query
    block, computes exactly the block mask's pairs (each KV head's list on its own)."""
    gen = torch.Generator().manual_seed(seed + 10)
    mask = kv_mask(2, 0.4, seed)
    block = (rows, 64)
    fmask = lt.refine_block_mask(mask, lt.FA4_BLOCK, block)
    table_row = torch.randperm(N // page + 7, generator=gen)[:N // page].to(torch.int32)  # a larger pool
    ref = token_pairs(mask, lt.FA4_BLOCK, N)
    for head in range(2):
        indptr, indices = lt.bsr_to_pages(*lt.block_mask_to_bsr(fmask[head]), block[1], page, table_row)
        assert len(indptr) == N // rows + 1 and int(indptr[-1]) == indices.numel()
        assert torch.equal(flashinfer_pairs(indptr, indices, rows, page, table_row, N), ref[head])


def test_bsr_to_pages_rejects_pages_wider_than_blocks():
    with pytest.raises(ValueError):
        lt.bsr_to_pages(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), 64, 128,
                        torch.arange(4, dtype=torch.int32))


@pytest.mark.parametrize("block", [(128, 128), (128, 64)])
@pytest.mark.parametrize("group", [1, 3])
def test_fa4_tensors_compute_the_mask(block, group):
    hkv = 2
    mask = kv_mask(hkv, 0.4, seed=block[1] + group)
    fmask = mask if block == lt.FA4_BLOCK else lt.refine_block_mask(mask, lt.FA4_BLOCK, block)
    m_cnt, m_idx, f_cnt, f_idx = lt.block_mask_to_fa4(fmask, block, group)
    h, m, nk = hkv * group, N // block[0], N // block[1]
    for t in (m_cnt, m_idx, f_cnt, f_idx):
        assert t.dtype == torch.int32 and t.is_contiguous() and t.shape[:3] == (1, h, m)
    partial = fa4_listed(m_cnt, m_idx, nk)
    full = fa4_listed(f_cnt, f_idx, nk)
    assert not (partial & full).any()
    q0 = torch.arange(m)[:, None] * block[0]
    k0 = torch.arange(nk)[None, :] * block[1]
    # "full" blocks need no mask: every key before every query of the block; "mask" blocks touch the diagonal
    assert not (full & (k0 + block[1] - 1 > q0)).any()
    assert not (partial & ~((k0 <= q0 + block[0] - 1) & (k0 + block[1] - 1 > q0))).any()
    for cnt, idx in ((m_cnt, m_idx), (f_cnt, f_idx)):
        for head in range(h):
            for mb in range(m):
                listed = idx[0, head, mb, :int(cnt[0, head, mb])].tolist()
                assert listed == sorted(set(listed))
    got = token_pairs((partial | full).reshape(h, m, nk), block, N)
    assert torch.equal(got, token_pairs(mask, lt.FA4_BLOCK, N).repeat_interleave(group, 0))
    # the varlen form: the same lists, each padded to the row's key blocks, with its offsets
    vm_cnt, vm_idx, vf_cnt, vf_idx, cu_m, cu_idx = lt.fa4_varlen((m_cnt, m_idx, f_cnt, f_idx), nk)
    assert cu_m.tolist() == [0, m] and cu_idx.tolist() == [0, m * nk]
    for cnt, idx, vcnt, vidx in ((m_cnt, m_idx, vm_cnt, vm_idx), (f_cnt, f_idx, vf_cnt, vf_idx)):
        assert torch.equal(vcnt, cnt[0]) and vidx.shape == (h, m * nk)
        assert torch.equal(fa4_listed(vcnt[None], vidx.view(1, h, m, nk), nk), fa4_listed(cnt, idx, nk))


@pytest.mark.parametrize("seed", [0, 1])
def test_our_index_and_pair_count(seed):
    mask = kv_mask(2, 0.3, seed)
    mask64 = lt.refine_block_mask(mask, lt.FA4_BLOCK, lt.OUR_BLOCK)
    ix = lt.our_index(mask64, N)
    assert ix.num_heads == 2 and ix.column_index.shape[-1] == 0 and ix.range_start.shape[-1] == 0
    ref = token_pairs(mask, lt.FA4_BLOCK, N)
    assert torch.equal(index_to_dense_mask(ix, N, 0), ref)
    mask_128x64 = lt.refine_block_mask(mask, lt.FA4_BLOCK, (128, 64))
    pairs = int(ref.sum())
    assert lt.visible_pairs(mask, lt.FA4_BLOCK) == lt.visible_pairs(mask64, lt.OUR_BLOCK) == pairs
    assert lt.visible_pairs(mask_128x64, (128, 64)) == pairs


@pytest.mark.kernels
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 64), (6, 2, 64), (4, 2, 128), (8, 2, 128)])
@pytest.mark.parametrize("page", [64, 16])
def test_ours_on_the_refined_mask_matches_float64(heads, kv_heads, d, page):
    """Our kernel on the 64 x 64 split of a 128 x 128 mask (group-shared lists packed as the
    launcher packs them: at head dim 128 two or four heads of a group stacked per program)
    computes float64 attention over the 128 x 128 mask's pairs. Triton's interpreter on CPU (fp16:
    its bf16 tl.dot is wrong), the GPU where there is one."""
    import triton_setup  # TRITON_INTERPRET before triton; a skip where triton is absent

    sa = triton_setup.kernel_module("prefill.attention")
    from benchmarks.kernels import paged_cache

    dev = "cuda" if triton_setup.CUDA and not triton_setup.INTERPRET else "cpu"
    n = 384
    gen = torch.Generator().manual_seed(heads + page + d)
    mask = lt.random_block_mask(kv_heads, n, 128, 0.5, gen)
    q, k, v = (torch.randn(n, x, d, generator=gen).to(torch.float16) for x in (heads, kv_heads, kv_heads))
    scale = 1.0 / math.sqrt(d)
    ref = masked_attention_f64(q, k, v, token_pairs(mask, lt.FA4_BLOCK, n).repeat_interleave(heads // kv_heads, 0),
                               scale)
    mask64 = lt.refine_block_mask(mask, lt.FA4_BLOCK, lt.OUR_BLOCK).to(dev)
    q, k, v = q.to(dev), k.to(dev), v.to(dev)
    key_cache, value_cache, table = paged_cache(k, v, page, dev)
    out = torch.full_like(q, float("nan"))
    bix = lt.pack_ours(sa, lt.our_index(mask64, n), heads, d, n, dev)
    sa.sparse_prefill_attention(q, key_cache, value_cache, table, [(0, 0, n, 0)], bix, scale, out)
    err = (out.double().cpu() - ref).abs().max().item()
    assert err < 1e-2, f"max abs err {err:.3e}"


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2)])
def test_sampled_rows_reference_is_the_masked_attention_of_those_rows(heads, kv_heads):
    """The study's float64 check of sampled rows equals the package's float64 masked attention
    over the block mask's token pairs on those rows, and its error measure flags a method that
    drops one listed block from a late row."""
    gen = torch.Generator().manual_seed(heads)
    mask = lt.random_block_mask(kv_heads, N, 128, 0.5, gen)
    q, k, v = (torch.randn(N, x, 32, generator=gen) for x in (heads, kv_heads, kv_heads))
    rows = lt.sampled_rows(N, 16)
    assert rows[0] == 0 and rows[-1] == N - 1 and len(rows) == 16
    full = masked_attention_f64(q, k, v, token_pairs(mask, lt.FA4_BLOCK, N).repeat_interleave(heads // kv_heads, 0),
                                0.2)
    got = lt.f64_rows_reference(q, k, v, mask, lt.FA4_BLOCK, rows, 0.2)
    assert torch.allclose(got, full[rows], atol=1e-12)
    assert lt.rows_rel_error(full.float(), got, rows) < 1e-6
    # the last row without its first listed key block other than the diagonal one
    dropped = mask.clone()
    kb = int(dropped[0, -1, :-1].nonzero()[0])
    dropped[0, -1, kb] = False
    wrong = masked_attention_f64(q, k, v,
                                 token_pairs(dropped, lt.FA4_BLOCK, N).repeat_interleave(heads // kv_heads, 0), 0.2)
    assert lt.rows_rel_error(wrong, got, rows) > lt.MISMATCH
