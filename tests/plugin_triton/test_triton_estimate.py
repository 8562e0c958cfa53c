"""GPU index estimation (vllm_sparse_kernels/prefill/estimate.py) vs the torch pattern estimators.

Every case builds a row's K in a paged cache (pages in random order, NaN in the unused slots,
garbage in the block table past the row), runs the torch estimator on the row's contiguous K and
``build_index``, and requires the device path's SparseIndex to be identical: same counts, same
lists (the widths may differ; -1 padding is compared).

CPU: Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported when there is
no CUDA), small sizes, fp32 / fp16. GPU: realistic sizes, bf16. Skipped where triton is missing.
Random data: scores have no exact ties, which the device path may break differently (see the
module docstring of estimate.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from triton_setup import CUDA, INTERPRET, kernel_module
from kernel_helpers import assert_same_index, fp8_cache, make_row, no_host_sync

from vllm_sparse_backend.prefill.index import build_index, num_blocks
from vllm_sparse_backend.prefill.patterns.a_shape import a_shape_selection
from vllm_sparse_backend.prefill.patterns.block_sparse import block_sparse_selection
from vllm_sparse_backend.prefill.patterns.base import block_means
from vllm_sparse_backend.prefill.patterns.flex_prefill import flex_prefill_selection
from vllm_sparse_kernels.prefill.estimate_math import scored_block_mass
from vllm_sparse_backend.prefill.patterns.block_sparse import row_keys
from vllm_sparse_kernels.kv_layout import kv_head_map

pytestmark = pytest.mark.kernels  # `make test` runs these with triton, under its interpreter on CPU

est = kernel_module("prefill.estimate")
cpu_only = pytest.mark.skipif(not INTERPRET, reason="interpreter tests run only with TRITON_INTERPRET=1 (no CUDA)")


def gpu(fn):
    skip = pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA (and TRITON_INTERPRET unset)")
    return pytest.mark.gpu(skip(fn))


# ------------------------------------------------------------------------------------------
# Checks (device-agnostic)
# ------------------------------------------------------------------------------------------

def check_pooled(q_len, ctx_len, hkv, d, page, dtype, block, seed, device):
    _, k, key_cache, table = make_row(q_len, ctx_len, hkv, 1, d, page, dtype, seed, device)
    with no_host_sync(device):
        got = est.pooled_keys(key_cache, table, ctx_len + q_len, block)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.cpu(), block_means(k, block), rtol=1e-5, atol=1e-5)


def check_block_sparse(q_len, ctx_len, hkv, group, d, page, dtype, seed, device, max_topk=None, tol=0.0):
    q, k, key_cache, table = make_row(q_len, ctx_len, hkv, group, d, page, dtype, seed, device, structure=1.0)
    h = hkv * group
    gen = torch.Generator().manual_seed(seed + 1)
    nkb = num_blocks(ctx_len + q_len, 64)
    topk = torch.randint(1, max(2, min(nkb, max_topk or nkb)) + 1, (h,), generator=gen)
    sel = block_sparse_selection(q, k, kv_head_map(h, hkv), ctx_len, topk, block_size=64)
    ref = build_index(sel.block_mask, 64, q_len, ctx_len)
    q_dev, topk_dev = q.to(device), topk.to(device)
    with no_host_sync(device):
        pk = est.pooled_keys(key_cache, table, ctx_len + q_len, 64)
        got = est.block_sparse_index(q_dev, pk, ctx_len, topk_dev, 64, max_topk=max_topk)
    assert_same_index(got, ref, tol)


def check_antidiagonal(q_len, ctx_len, hkv, group, d, page, dtype, seed, device, stride=16, block_mass=None,
                       share=1, max_topk=None, tol=0.0, scoring="antidiagonal", samples=2):
    q, k, key_cache, table = make_row(q_len, ctx_len, hkv, group, d, page, dtype, seed, device, structure=1.0)
    h = hkv * group
    gen = torch.Generator().manual_seed(seed + 1)
    nkb = num_blocks(ctx_len + q_len, 64)
    topk = torch.randint(1, max(2, min(nkb, max_topk or nkb)) + 1, (h // share,), generator=gen)
    scale = d ** -0.5
    sel = block_sparse_selection(q, k, kv_head_map(h, hkv), ctx_len, topk.repeat_interleave(share), block_size=64,
                                 share=share, scoring=scoring, stride=stride, block_mass=block_mass,
                                 scale=scale, samples=samples)
    ref = build_index(sel.block_mask, 64, q_len, ctx_len)
    q_dev, topk_dev = q.to(device), topk.to(device)
    with no_host_sync(device):
        k_row = row_keys(key_cache, table, ctx_len + q_len, q_dev.dtype)
        mass = scored_block_mass(scoring, q_dev, k_row, ctx_len, 64, scale, share, stride=stride, samples=samples)
        got = est.mass_block_index(mass, topk_dev, q_len, ctx_len, 64, max_topk, block_mass)
    assert torch.equal(k_row.cpu(), k.to(q_dev.dtype)), "the row's keys gathered out of the pages"
    assert_same_index(got.repeat_heads(share), ref, tol)


def check_a_shape(q_len, ctx_len, h, seed, device, max_blocks=None):
    gen = torch.Generator().manual_seed(seed)
    sink = torch.randint(0, 200, (h,), generator=gen)
    window = torch.randint(1, 400, (h,), generator=gen)
    sel = a_shape_selection(sink, window, q_len, ctx_len, 64)
    ref = build_index(sel.block_mask, 64, q_len, ctx_len)
    sink_dev, window_dev = sink.to(device), window.to(device)
    with no_host_sync(device):
        got = est.a_shape_index(sink_dev, window_dev, q_len, ctx_len, 64, max_blocks=max_blocks)
    assert_same_index(got, ref)


def _split_tau(jsd: torch.Tensor) -> float:
    """A tau in the widest gap between the heads' sqrt-JSD values: some heads on each side, far
    from the boundary (so float differences cannot flip a decision). Without a clear gap (e.g. a
    row with a single flex key block: every sqrt-JSD is 0) all heads go query-aware."""
    v = jsd.double().sort().values
    gaps = v[1:] - v[:-1]
    if gaps.numel() == 0 or gaps.max() < 1e-3:
        return float(v.max()) + 0.05
    i = int(gaps.argmax())
    return float((v[i] + v[i + 1]) / 2)


def check_flex(q_len, ctx_len, hkv, group, d, page, dtype, seed, device, *, fb=128, tau="split", gamma=0.9,
               min_budget=64, max_budget=None, max_columns=None, tol=0.0):
    q, k, key_cache, table = make_row(q_len, ctx_len, hkv, group, d, page, dtype, seed, device, structure=1.5)
    h = hkv * group
    scale = 1.0 / math.sqrt(d)
    gen = torch.Generator().manual_seed(seed + 2)
    gammas = gamma * (0.8 + 0.2 * torch.rand(h, generator=gen))
    kvh = kv_head_map(h, hkv)
    kw = dict(flex_block_size=fb, min_budget=min_budget, max_budget=max_budget, block_size=64, scale=scale)
    if tau == "split":
        _, dec = flex_prefill_selection(q, k, kvh, ctx_len, gammas, tau=0.0, **kw)
        tau = _split_tau(dec.jsd)
    sel, dec = flex_prefill_selection(q, k, kvh, ctx_len, gammas, tau=tau, **kw)
    ref = sel.to_index(64, q_len, ctx_len)
    q_dev, gammas_dev = q.to(device), gammas.to(device)
    with no_host_sync(device):
        got, qa = est.flex_prefill_index(q_dev, key_cache, table, ctx_len, gammas_dev, tau=tau,
                                         max_columns=max_columns, **kw)
    assert torch.equal(qa.cpu(), dec.query_aware)
    assert_same_index(got, ref, tol)
    return dec.query_aware


# ------------------------------------------------------------------------------------------
# CPU (interpreter), small sizes
# ------------------------------------------------------------------------------------------

SHAPES = [(70, 0), (37, 45), (130, 100), (200, 333)]  # (q_len, ctx_len): none multiples of 64
GEOM = [(1, 64, 16, torch.float32), (4, 64, 32, torch.float16), (7, 128, 16, torch.float32),
        (4, 128, 32, torch.float32)]  # (group, D, page, dtype)


@cpu_only
@pytest.mark.parametrize("group,d,page,dtype", GEOM)
@pytest.mark.parametrize("block", [64, 128])
def test_interp_pooled_keys(group, d, page, dtype, block):
    for i, (q_len, ctx) in enumerate(SHAPES):
        check_pooled(q_len, ctx, 2, d, page, dtype, block, seed=i + d + page, device="cpu")


@cpu_only
@pytest.mark.parametrize("group,d,page,dtype", GEOM)
def test_interp_block_sparse(group, d, page, dtype):
    hkv = 1 if group == 7 else 2
    for i, (q_len, ctx) in enumerate(SHAPES):
        check_block_sparse(q_len, ctx, hkv, group, d, page, dtype, seed=10 * i + group, device="cpu")


@cpu_only
def test_interp_block_sparse_capped_width():
    # max_topk bounds the list width to max_topk + 1; topk values drawn at most max_topk
    check_block_sparse(300, 500, 2, 4, 64, 16, torch.float32, seed=5, device="cpu", max_topk=3)
    check_block_sparse(37, 45, 1, 4, 64, 32, torch.float32, seed=6, device="cpu", max_topk=1)
    check_block_sparse(150, 2500, 2, 4, 64, 16, torch.float32, seed=7, device="cpu", max_topk=8)


@cpu_only
@pytest.mark.parametrize("stride,block_mass,share", [(16, None, 1), (8, 0.9, 1), (4, 0.7, 4), (16, 0.95, 4)])
def test_interp_antidiagonal_block_sparse(stride, block_mass, share):
    for i, (q_len, ctx) in enumerate(SHAPES):
        check_antidiagonal(q_len, ctx, 2, 4, 64, 16, torch.float32, seed=20 + i, device="cpu", stride=stride,
                           block_mass=block_mass, share=share)
    check_antidiagonal(150, 2500, 2, 4, 128, 32, torch.float16, seed=3, device="cpu", block_mass=0.9, max_topk=8)


@cpu_only
@pytest.mark.parametrize("samples,block_mass,share", [(1, None, 1), (2, 0.9, 1), (4, 0.7, 4)])
def test_interp_sampled_block_sparse(samples, block_mass, share):
    for i, (q_len, ctx) in enumerate(SHAPES):
        check_antidiagonal(q_len, ctx, 2, 4, 64, 16, torch.float32, seed=30 + i, device="cpu", scoring="sampled",
                           samples=samples, block_mass=block_mass, share=share)


@cpu_only
@pytest.mark.parametrize("group,d,page,dtype", GEOM)
def test_interp_flex_prefill_mixed(group, d, page, dtype):
    hkv = 1 if group == 7 else 2
    seen = torch.zeros(2, dtype=torch.long)
    for i, (q_len, ctx) in enumerate(SHAPES[1:]):  # q_len >= 37; representative block = up to 128 queries
        qa = check_flex(q_len, ctx, hkv, group, d, page, dtype, seed=100 + 10 * i + group, device="cpu")
        seen += torch.stack([qa.sum(), (~qa).sum()])
    if group > 1:
        assert (seen > 0).all(), "both FlexPrefill branches should have been exercised"


@cpu_only
@pytest.mark.parametrize("fb,tau,gamma,min_budget,max_budget", [
    (64, 1.0, 0.9, 64, None),     # all query-aware, flex block = block
    (128, 1.0, 0.6, 128, 256),    # all query-aware, max budget cuts rows
    (32, 1.0, 0.8, 0, None),      # flex block below the block: any-pooling to 64
    (64, 0.0, 0.9, 64, None),     # all vertical-slash
    (128, 0.0, 0.5, 200, 300),    # vertical-slash with both budget clamps
    (256, "split", 0.95, 64, None),  # representative block of 256 queries (4 chunks of 64)
])
def test_interp_flex_prefill_settings(fb, tau, gamma, min_budget, max_budget):
    check_flex(300, 211, 2, 2, 64, 16, torch.float32, seed=fb + min_budget, device="cpu", fb=fb, tau=tau,
               gamma=gamma, min_budget=min_budget, max_budget=max_budget)


@cpu_only
@pytest.mark.parametrize("fb,tau,gamma,max_budget", [
    (64, "split", 0.7, None), (128, "split", 0.6, None), (64, 0.0, 0.9, 150), (128, 1.0, 0.5, None)])
def test_interp_flex_prefill_long_context(fb, tau, gamma, max_budget):
    # 42 key blocks: selections well below dense; max_budget=150 leaves columns outside the slash blocks
    check_flex(150, 2500, 2, 4, 64, 16, torch.float32, seed=fb + 7, device="cpu", fb=fb, tau=tau, gamma=gamma,
               min_budget=64, max_budget=max_budget)


@cpu_only
def test_interp_flex_prefill_short_chunk():
    # a chunk shorter than the flex block and than one 64-query chunk, at the start and mid-sequence
    check_flex(20, 0, 1, 4, 64, 16, torch.float32, seed=3, device="cpu", tau=1.0)
    check_flex(50, 300, 1, 4, 64, 32, torch.float32, seed=4, device="cpu", tau=0.0)


@cpu_only
@pytest.mark.parametrize("q_len,ctx_len", SHAPES + [(1, 0), (64, 64), (500, 1000)])
def test_interp_a_shape(q_len, ctx_len):
    check_a_shape(q_len, ctx_len, 5, seed=q_len + ctx_len, device="cpu")
    check_a_shape(q_len, ctx_len, 5, seed=q_len + ctx_len, device="cpu", max_blocks=num_blocks(200, 64)
                  + num_blocks(400, 64) + 2)


@cpu_only
@pytest.mark.parametrize("block", [64, 128])
def test_interp_pooled_keys_fp8_cache(block):
    # means of the dequantised keys, the scale applied on the device (a one-element tensor)
    for i, (q_len, ctx) in enumerate(SHAPES):
        _, _, key_cache, table = make_row(q_len, ctx, 2, 1, 64, 16, torch.float32, i, "cpu")
        k8 = fp8_cache(key_cache, 0.043)
        pages = table[:num_blocks(q_len + ctx, 16)].long()
        k = k8.view(torch.uint8)[pages].view(k8.dtype).reshape(-1, 2, 64)[:q_len + ctx].double() * 0.043
        with no_host_sync("cpu"):
            got = est.pooled_keys(k8, table, ctx + q_len, block, torch.tensor([0.043]))
        torch.testing.assert_close(got.double(), block_means(k, block).double(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------
# GPU, realistic sizes
# ------------------------------------------------------------------------------------------

@gpu
def test_gpu_pooled_keys():
    check_pooled(5000, 3000, 8, 128, 16, torch.bfloat16, 64, seed=1, device="cuda")
    check_pooled(5000, 3000, 8, 128, 16, torch.bfloat16, 128, seed=1, device="cuda")


@gpu
@pytest.mark.parametrize("group,d,page", [(4, 128, 16), (7, 64, 32)])
def test_gpu_block_sparse(group, d, page):
    check_block_sparse(5000, 3000, 2, group, d, page, torch.bfloat16, seed=group, device="cuda", max_topk=100,
                       tol=1e-3)


@gpu
@pytest.mark.parametrize("block_mass,share", [(None, 1), (0.9, 4)])
def test_gpu_antidiagonal_block_sparse(block_mass, share):
    check_antidiagonal(5000, 3000, 2, 4, 128, 16, torch.bfloat16, seed=4, device="cuda", block_mass=block_mass,
                       share=share, max_topk=100, tol=1e-2)


@gpu
@pytest.mark.parametrize("block_mass,share", [(None, 1), (0.9, 4)])
def test_gpu_sampled_block_sparse(block_mass, share):
    check_antidiagonal(5000, 3000, 2, 4, 128, 16, torch.bfloat16, seed=5, device="cuda", block_mass=block_mass,
                       share=share, max_topk=100, tol=1e-2, scoring="sampled")


@gpu
def test_gpu_a_shape():
    check_a_shape(5000, 3000, 32, seed=1, device="cuda")


@gpu
@pytest.mark.parametrize("fb", [64, 128])
def test_gpu_flex_prefill(fb):
    # the torch reference runs on the CPU: float summation order differs, so a few lists may too
    check_flex(5000, 3000, 2, 4, 128, 16, torch.bfloat16, seed=fb, device="cuda", fb=fb, min_budget=1024,
               max_columns=8000, tol=1e-2)
