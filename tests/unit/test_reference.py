"""The torch reference computes exactly softmax(QK^T*scale + mask)V for the mask an index selects."""

import pytest
import torch

from vllm_sparse_kernels.reference.dense import causal_mask, masked_attention_f64
from vllm_sparse_backend.prefill.index import build_index, causal_block_mask, count_pairs, num_blocks
from vllm_sparse_kernels.reference.index import index_to_dense_mask
from vllm_sparse_backend.prefill.plan import SparseRow
from vllm_sparse_backend.observability.record import run_recorded
from vllm_sparse_backend.observability.stats import SparseStats
from vllm_sparse_kernels.index_format import causal_pairs
from vllm_sparse_kernels.kv_layout import gather_paged_kv
from vllm_sparse_kernels.torch_attention import sparse_attention

SHAPES = [  # (num_heads, num_kv_heads, head_dim)
    (4, 4, 64), (8, 2, 128), (7, 1, 64), (14, 2, 64),
]


def _inputs(q_len, ctx_len, h, hkv, d, gen, dtype=torch.float64):
    kv_len = ctx_len + q_len
    q = torch.randn(q_len, h, d, generator=gen, dtype=dtype)
    k = torch.randn(kv_len, hkv, d, generator=gen, dtype=dtype)
    v = torch.randn(kv_len, hkv, d, generator=gen, dtype=dtype)
    return q, k, v


def _random_index(h, q_len, ctx_len, b, gen, p_block=0.3, n_cols=20):
    nqb, nkb = num_blocks(q_len, b), num_blocks(ctx_len + q_len, b)
    blocks = torch.rand(h, nqb, nkb, generator=gen) < p_block
    cols = torch.randint(0, ctx_len + q_len, (h, n_cols), generator=gen)
    keep = torch.rand(h, n_cols, generator=gen) < 0.8
    return build_index(blocks, b, q_len, ctx_len, cols, keep)


@pytest.mark.parametrize("h,hkv,d", SHAPES)
@pytest.mark.parametrize("q_len,ctx_len", [(1, 0), (63, 0), (200, 0), (129, 77), (97, 300)])
def test_full_mask_equals_dense(h, hkv, d, q_len, ctx_len, rng):
    q, k, v = _inputs(q_len, ctx_len, h, hkv, d, rng)
    b = 64
    full = causal_block_mask(q_len, ctx_len, b)[None].expand(h, -1, -1).clone()
    index = build_index(full, b, q_len, ctx_len)
    scale = d ** -0.5
    out, computed = sparse_attention(q, k, v, index, ctx_len, scale)
    ref = masked_attention_f64(q, k, v, causal_mask(h, q_len, ctx_len), scale)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert computed == causal_pairs(q_len, ctx_len, h) == count_pairs(index, q_len, ctx_len)


@pytest.mark.parametrize("h,hkv,d", SHAPES)
@pytest.mark.parametrize("q_len,ctx_len,b", [(150, 0, 64), (333, 45, 64), (70, 200, 32), (257, 31, 16)])
def test_random_mask_equals_masked_dense(h, hkv, d, q_len, ctx_len, b, rng):
    q, k, v = _inputs(q_len, ctx_len, h, hkv, d, rng)
    index = _random_index(h, q_len, ctx_len, b, rng)
    mask = index_to_dense_mask(index, q_len, ctx_len)
    # The mask must really be sparse and contain columns outside the listed blocks.
    assert 0 < mask.sum() < causal_mask(h, q_len, ctx_len).sum()
    scale = d ** -0.5
    out, computed = sparse_attention(q, k, v, index, ctx_len, scale)
    ref = masked_attention_f64(q, k, v, mask, scale)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert computed == int(mask.sum()) == count_pairs(index, q_len, ctx_len)


def test_index_lists_are_sorted_disjoint_and_causal(rng):
    h, q_len, ctx_len, b = 3, 300, 130, 64
    index = _random_index(h, q_len, ctx_len, b, rng, n_cols=64)
    _, q_last = torch.arange(0, q_len, b) + ctx_len, torch.clamp(torch.arange(0, q_len, b) + b, max=q_len) - 1 + ctx_len
    for hh in range(h):
        for qb in range(index.num_query_blocks):
            blocks = index.block_index[hh, qb, : index.block_count[hh, qb]].tolist()
            cols = index.column_index[hh, qb, : index.column_count[hh, qb]].tolist()
            assert blocks == sorted(set(blocks)) and cols == sorted(set(cols))
            assert all(kb * b <= q_last[qb] for kb in blocks)
            assert all(c <= q_last[qb] and c // b not in blocks for c in cols)
            assert (index.block_index[hh, qb, index.block_count[hh, qb]:] == -1).all()
            assert (index.column_index[hh, qb, index.column_count[hh, qb]:] == -1).all()


def test_low_precision_inputs_close_to_float64(rng):
    h, hkv, d, q_len, ctx_len = 8, 2, 64, 300, 50
    q, k, v = _inputs(q_len, ctx_len, h, hkv, d, rng)
    index = _random_index(h, q_len, ctx_len, 64, rng)
    ref = masked_attention_f64(q, k, v, index_to_dense_mask(index, q_len, ctx_len), d ** -0.5)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out, _ = sparse_attention(q.to(dtype), k.to(dtype), v.to(dtype), index, ctx_len, d ** -0.5)
        assert out.dtype == dtype and torch.isfinite(out).all()
        rel = (out.double() - ref).norm() / ref.norm()
        assert rel < (1e-2 if dtype != torch.float32 else 1e-5), (dtype, rel)


def test_softcap(rng):
    h, hkv, d, q_len = 2, 1, 64, 80
    q, k, v = _inputs(q_len, 0, h, hkv, d, rng)
    q = q * 4
    full = causal_block_mask(q_len, 0, 64)[None].expand(h, -1, -1).clone()
    out, _ = sparse_attention(q, k, v, build_index(full, 64, q_len, 0), 0, 0.125, softcap=5.0)
    qd, kd = q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1)
    s = 5.0 * torch.tanh((qd @ kd.transpose(-1, -2)) * 0.125 / 5.0)
    s = s.masked_fill(~causal_mask(h, q_len, 0), float("-inf"))
    ref = (torch.softmax(s, -1) @ v.repeat_interleave(2, 1).transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_batch_of_rows_through_the_paged_cache(rng):
    """Several rows of different lengths, some with cached context, K/V read from a shuffled
    paged cache: each row equals its own masked dense attention."""
    from vllm_sparse_backend.prefill.run import run_sparse_rows
    from vllm_sparse_backend.settings import SparseSettings
    from vllm_sparse_backend.head_configs import resolve_head, HeadPattern

    h, hkv, d, page = 4, 2, 64, 16
    rows_geom = [(130, 0), (77, 200), (300, 33)]  # (q_len, ctx_len)
    n_tok = sum(q for q, _ in rows_geom)
    query = torch.randn(n_tok, h, d, generator=rng, dtype=torch.float64)
    pages_needed = [num_blocks(q + c, page) for q, c in rows_geom]
    num_pages = sum(pages_needed) + 5
    perm = torch.randperm(num_pages, generator=rng)
    # [num_pages, Hkv, page, 2D] logical cache in HND physical order, viewed like vLLM does.
    kv_cache = torch.randn(num_pages, hkv, page, 2 * d, generator=rng, dtype=torch.float64)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(d, dim=-1)
    block_table = torch.full((len(rows_geom), max(pages_needed)), -1, dtype=torch.int32)
    used = 0
    rows, tok = [], 0
    for i, (q_len, ctx) in enumerate(rows_geom):
        block_table[i, : pages_needed[i]] = perm[used: used + pages_needed[i]].int()
        used += pages_needed[i]
        rows.append(SparseRow(i, tok, q_len, ctx))
        tok += q_len
    settings = SparseSettings(vertical_size=40, slash_size=60, last_q=32, min_budget=64, topk_blocks=2)
    heads = [resolve_head(HeadPattern(pattern=p), settings)
             for p in ("vertical_slash", "block_sparse", "a_shape", "flex_prefill")]
    output = torch.full_like(query, float("nan"))
    run_recorded(SparseStats(), run_sparse_rows, query, output, rows,
                 lambda r: gather_paged_kv(key_cache, value_cache, block_table[r.row], r.ctx_len + r.q_len),
                 heads, settings, d ** -0.5, 0.0, None)
    assert torch.isfinite(output).all()
    from vllm_sparse_backend.prefill.estimate import estimate_index
    for r in rows:
        k, v = gather_paged_kv(key_cache, value_cache, block_table[r.row], r.ctx_len + r.q_len)
        # independent K/V: straight from the logical cache, page by page
        pages = block_table[r.row, : num_blocks(r.ctx_len + r.q_len, page)].long()
        k2 = kv_cache[pages, :, :, :d].permute(0, 2, 1, 3).reshape(-1, hkv, d)[: r.ctx_len + r.q_len]
        torch.testing.assert_close(k, k2, rtol=0, atol=0)
        q = query[r.tok_start: r.tok_start + r.q_len]
        est = estimate_index(q, k, r.ctx_len, heads, settings, d ** -0.5)
        ref = masked_attention_f64(q, k, v, index_to_dense_mask(est.index, r.q_len, r.ctx_len), d ** -0.5)
        torch.testing.assert_close(output[r.tok_start: r.tok_start + r.q_len], ref, rtol=1e-10, atol=1e-10)
