"""The plugin's Triton estimation for vertical-slash heads against its torch path: the GPU index
conversion (vllm_sparse_kernels/prefill/vs_index.py) against the torch selection of the pattern
(``vertical_slash_to_selection``), the last queries' scores against the pattern's float sums,
and the serving run (``run_sparse_rows_paged``: estimation on the paged cache + the Triton
kernel) against the torch run (``run_sparse_rows``).

Moved out of tests/kernels/test_triton_kernels.py (issue 52): these exercise the plugin's code,
and the kernel tests import only the kernel package. CPU: Triton's interpreter at tiny sizes;
GPU: realistic sizes. Skipped where triton is missing.
"""

from __future__ import annotations

import math

import pytest
import torch

from triton_setup import CUDA, INTERPRET, kernel_module
from kernel_helpers import make_cache, quantize_cache

from vllm_sparse_kernels.kv_layout import gather_paged_kv

from vllm_sparse_backend.observability.record import run_recorded
from vllm_sparse_backend.observability.stats import SparseStats

pytestmark = pytest.mark.kernels  # `make test` runs these with triton, under its interpreter on CPU

sa = kernel_module("prefill.attention")
DEV = "cuda" if CUDA and not INTERPRET else "cpu"
E4M3 = torch.float8_e4m3fn
SCALES = (0.043, 0.021)
cpu_only = pytest.mark.skipif(not INTERPRET, reason="interpreter tests run only with TRITON_INTERPRET=1 (no CUDA)")


def gpu(fn):
    skip = pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA (and TRITON_INTERPRET unset)")
    return pytest.mark.gpu(skip(fn))


# ------------------------------------------------------------------------------------------
# GPU index building for vertical-slash heads (vllm_sparse_kernels/prefill/vs_index.py)
# ------------------------------------------------------------------------------------------

vsi = pytest.importorskip("vllm_sparse_kernels.prefill.vs_index",
                          reason="vllm_sparse_kernels is not installed (pip install -e .)")
DIAG_MODES = sorted(vsi.DIAG_MODES)


def _padded_equal(a, b):
    w = max(a.shape[-1], b.shape[-1])
    pad = lambda t: torch.nn.functional.pad(t.to(torch.int64).cpu(), (0, w - t.shape[-1]), value=-1)  # noqa: E731
    return torch.equal(pad(a), pad(b))


def check_vs_index(h, q_len, ctx_len, max_v, max_s, seed, device, uniform=False, select="auto", slash_tiles="ranges",
                   chunk=512):
    """``uniform``: every head keeps max_v / max_s, passed as host ints (vs_topk's unsorted path,
    by ``select``). The GPU conversion must give the torch conversion's lists exactly."""
    from vllm_sparse_backend.prefill.patterns.base import keep_top
    from vllm_sparse_backend.prefill.patterns.vertical_slash import vertical_slash_to_selection

    gen = torch.Generator().manual_seed(seed)
    kv_len = ctx_len + q_len
    vert = torch.rand(h, kv_len, generator=gen)
    slash = torch.rand(h, kv_len, generator=gen) ** 4  # favour nothing in particular; distinct values
    # forced entries (+inf) no more than the smallest budget: ties among them may break differently
    vert[:, :min(30, kv_len, max(1, max_v // 2))] = float("inf")
    slash[:, :min(30, kv_len, max(1, max_s // 2))] = float("inf")
    if uniform:
        v_count, s_count = torch.full((h,), max_v), torch.full((h,), max_s)
    else:
        v_count = torch.randint(max(1, max_v // 2), max_v + 1, (h,), generator=gen)
        s_count = torch.randint(max(1, max_s // 2), max_s + 1, (h,), generator=gen)
    v_keep = keep_top(vert, v_count.clamp(max=kv_len))
    s_keep = keep_top(slash, s_count.clamp(max=kv_len))
    sel = vertical_slash_to_selection(v_keep, s_keep, q_len, ctx_len, 64, slash_tiles)
    ref = sel.to_index(64, q_len, ctx_len)

    counts = (max_v, max_s) if uniform else (v_count.to(device), s_count.to(device))
    v_idx, v_cnt, s_idx, s_cnt = vsi.vs_topk(vert.to(device), slash.to(device), *counts, max_v, max_s, select=select)
    got = vsi.vertical_slash_index(v_idx, v_cnt, s_idx, s_cnt, q_len, ctx_len, slash_tiles=slash_tiles, chunk=chunk)
    assert torch.equal(got.block_count.cpu(), ref.block_count)
    assert _padded_equal(got.block_index, ref.block_index)
    assert torch.equal(got.range_count.cpu(), ref.range_count)
    assert _padded_equal(got.range_start, ref.range_start)
    assert torch.equal(got.column_count.cpu(), ref.column_count)
    assert _padded_equal(got.column_index, ref.column_index)


def odd_table_row(table_row: torch.Tensor) -> torch.Tensor:
    """The same pages as the second row of a 2-row block table whose rows are an odd number of
    int32 wide: the row's address is not 16-byte aligned, as in vLLM's table when
    max_model_len / page is odd (the first row and the profiling run's are aligned)."""
    width = table_row.shape[0] | 1
    table = torch.full((2, width), 10**6, dtype=torch.int32, device=table_row.device)
    table[1, :table_row.shape[0]] = table_row
    assert table[1].data_ptr() % 16 != 0
    return table[1]


def check_last_q(h, hkv, d, q_len, ctx_len, page, dtype, seed, device, tol, diagonals="skew", group_sum=False,
                 stack=None, split=128, odd_row=False, **launch):
    """``group_sum``: the kernel sums each KV group's heads itself (``stack`` heads per program);
    the reference sums the per-head float scores afterwards. ``odd_row``: the row's block table
    at an address that is not 16-byte aligned (:func:`odd_table_row`)."""
    from vllm_sparse_backend.prefill.patterns.base import last_queries_probs, vertical_and_slash_sums
    from vllm_sparse_kernels.kv_layout import kv_head_map

    gen = torch.Generator().manual_seed(seed)
    kv_len = ctx_len + q_len
    key_cache, value_cache, table, ks, _ = make_cache([kv_len], hkv, d, page, dtype, "NHD", gen, device)
    q = torch.randn(q_len, h, d, generator=gen).to(dtype)
    scale = 1.0 / math.sqrt(d)
    n = min(64, q_len)
    probs, qpos = last_queries_probs(q, ks[0], kv_head_map(h, hkv), ctx_len, n, scale)
    ref_v, ref_s = vertical_and_slash_sums(probs, qpos)
    row = odd_table_row(table[0]) if odd_row else table[0]
    got_v, got_s = vsi.last_q_scores(q[q_len - n:].to(device), key_cache, row, kv_len, scale, split=split,
                                     diagonals=diagonals, group_sum=group_sum, stack=stack, **launch)
    if group_sum:
        ref_v, ref_s = ref_v.view(hkv, h // hkv, -1).sum(1), ref_s.view(hkv, h // hkv, -1).sum(1)
    assert got_v.shape == ref_v.shape and got_s.shape == ref_s.shape
    for got, ref in ((got_v, ref_v), (got_s, ref_s)):
        err = ((got.cpu().double() - ref.double()).norm() / ref.double().norm()).item()
        assert err < tol, f"rel err {err:.2e}"


@cpu_only
@pytest.mark.parametrize("h,q_len,ctx_len,max_v,max_s", [(3, 300, 0, 40, 50), (2, 130, 211, 64, 300),
                                                          (4, 70, 1000, 200, 150), (2, 200, 3000, 100, 40)])
@pytest.mark.parametrize("slash_tiles", ["ranges", "blocks"])
def test_interp_vs_index(h, q_len, ctx_len, max_v, max_s, slash_tiles):
    check_vs_index(h, q_len, ctx_len, max_v, max_s, seed=q_len + ctx_len, device="cpu", slash_tiles=slash_tiles)


@cpu_only
def test_interp_vs_index_ranges_carry_segments_across_chunks():
    # 16 diagonals per step: segments (and their anchors) continue from one step to the next
    check_vs_index(2, 300, 700, 30, 200, seed=5, device="cpu", chunk=16)


@cpu_only
@pytest.mark.parametrize("h,q_len,ctx_len,max_v,max_s", [(3, 300, 0, 40, 50), (2, 130, 211, 400, 300),
                                                          (2, 40, 0, 64, 100)])
@pytest.mark.parametrize("select", ["torch", "radix"])
def test_interp_vs_index_uniform_budgets(h, q_len, ctx_len, max_v, max_s, select):
    # host-int budgets, some wider than the row (kv_len < max_v / max_s): padded with -1
    check_vs_index(h, q_len, ctx_len, max_v, max_s, seed=q_len + ctx_len + 1, device="cpu", uniform=True,
                   select=select)


@cpu_only
@pytest.mark.parametrize("diagonals", DIAG_MODES)
@pytest.mark.parametrize("q_len,ctx_len", [(100, 230), (40, 0), (64, 77)])
def test_interp_last_q_scores(diagonals, q_len, ctx_len):
    check_last_q(4, 2, 64, q_len, ctx_len, 16, torch.float32, seed=2, device="cpu", tol=1e-4,
                 diagonals=diagonals)


@cpu_only
@pytest.mark.parametrize("h,hkv,stack", [(8, 2, None), (8, 2, 2), (8, 2, 1), (6, 2, None), (7, 1, None)])
@pytest.mark.parametrize("diagonals", DIAG_MODES)
def test_interp_last_q_scores_group_sum(h, hkv, stack, diagonals):
    # stack = group: one program writes each KV head's sums; smaller stacks add atomically
    check_last_q(h, hkv, 64, 100, 230, 16, torch.float32, seed=4, device="cpu", tol=1e-4,
                 diagonals=diagonals, group_sum=True, stack=stack)


@cpu_only
@pytest.mark.parametrize("diagonals", DIAG_MODES)
def test_interp_last_q_scores_unaligned_table_row(diagonals):
    # the estimation kernels that take one block-table row are compiled for any row address: a
    # row vLLM hands over need not be 16-byte aligned where the profiling run's was
    check_last_q(8, 2, 64, 100, 230, 16, torch.float32, seed=9, device="cpu", tol=1e-4, diagonals=diagonals,
                 group_sum=True, odd_row=True)
    est = kernel_module("prefill.estimate")
    for kernel in (vsi._lastq_pass, vsi._lastq_skew_pass, est._pool_kernel):
        assert "bt_ptr" in kernel.kwargs["do_not_specialize_on_alignment"]


@cpu_only
@pytest.mark.parametrize("block_n", [32, 128])
def test_interp_last_q_scores_skew_tiles(block_n):
    # the skew mode takes any key tile width (the slab is indexed by key position, not by tile)
    check_last_q(8, 2, 64, 100, 230, 16, torch.float32, seed=6, device="cpu", tol=1e-4, group_sum=True,
                 block_n=block_n)


@cpu_only
@pytest.mark.parametrize("diagonals", ["skew", "gather"])
def test_interp_last_q_scores_many_key_ranges(diagonals):
    # 35 key ranges of 64 keys: the per-range row maxima/sums are merged 32 ranges at a time, most
    # ranges lie wholly below the first query (the unmasked loops), the last ones straddle it
    check_last_q(8, 2, 64, 100, 2140, 16, torch.float32, seed=8, device="cpu", tol=1e-4, diagonals=diagonals,
                 group_sum=True, split=64)


@cpu_only
@pytest.mark.parametrize("diagonals", DIAG_MODES)
@pytest.mark.parametrize("split,sample", [(128, 2), (256, 4), (64, 4)])
def test_interp_last_q_scores_sampled_normalizer(diagonals, split, sample):
    """normalizer_sample: pass 1 reads the first 128 keys and the 256 before the queries whole and
    one 64-key tile in ``sample`` between; the sums equal the torch twin's (sampled_softmax) with
    key ranges cut anywhere by ``split``, and differ from the exact ones (the sample is taken)."""
    from vllm_sparse_backend.prefill.patterns.base import vertical_and_slash_sums
    from vllm_sparse_kernels.kv_layout import kv_head_map
    from vllm_sparse_kernels.prefill.estimate_math import sampled_softmax

    gen = torch.Generator().manual_seed(sample + split)
    h, hkv, d, n, kv_len = 4, 2, 32, 64, 1564
    key_cache, _, table, ks, _ = make_cache([kv_len], hkv, d, 16, torch.float32, "NHD", gen, "cpu")
    q = torch.randn(n, h, d, generator=gen)
    scale = 1.0 / math.sqrt(d)
    qpos = torch.arange(kv_len - n, kv_len)
    s = torch.einsum("nhd,khd->hnk", q, ks[0][:, kv_head_map(h, hkv)]) * scale
    s = s.masked_fill(torch.arange(kv_len)[None, None, :] > qpos[None, :, None], float("-inf"))
    probs = sampled_softmax(s, torch.arange(kv_len), kv_len - n, sample, first_keys=128, window=256)
    ref_v, ref_s = vertical_and_slash_sums(probs, qpos)
    got_v, got_s = vsi.last_q_scores(q, key_cache, table[0], kv_len, scale, split=split, diagonals=diagonals,
                                     normalizer_sample=sample, first_keys=128, window=256)
    exact_v, _ = vsi.last_q_scores(q, key_cache, table[0], kv_len, scale, split=split, diagonals=diagonals)
    for got, ref in ((got_v, ref_v), (got_s, ref_s)):
        assert ((got.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-4
    assert ((got_v - exact_v).norm() / exact_v.norm()).item() > 1e-3


def check_last_q_fp8(h, hkv, d, q_len, ctx_len, dtype, seed, device, tol, diagonals, group_sum, k_scale):
    """last_q_scores on an fp8 cache with its k scale: the float64 sums over the dequantised keys
    within ``tol``, and the scores the same kernels give on a cache holding the dequantised keys
    in the query's dtype to within fp32 rounding (the scale folded into the scores' scale instead
    of into the keys)."""
    from vllm_sparse_backend.prefill.patterns.base import last_queries_probs, vertical_and_slash_sums
    from vllm_sparse_kernels.kv_layout import kv_head_map

    gen = torch.Generator().manual_seed(seed)
    kv_len = ctx_len + q_len
    key_cache, value_cache, table, _, _ = make_cache([kv_len], hkv, d, 16, torch.float32, "NHD", gen, device)
    k8, _ = quantize_cache(key_cache, value_cache, E4M3, float(k_scale), 1.0, "NHD")
    deq = (k8.float() * float(k_scale)).to(dtype)  # the dequantised cache (exact in fp32; in bf16 for 2^-n)
    k = gather_paged_kv(k8, k8, table[0], kv_len)[0].cpu().double() * float(k_scale)
    q = torch.randn(q_len, h, d, generator=gen).to(dtype)
    scale = 1.0 / math.sqrt(d)
    n = min(64, q_len)
    probs, qpos = last_queries_probs(q.double(), k, kv_head_map(h, hkv), ctx_len, n, scale)
    ref_v, ref_s = vertical_and_slash_sums(probs, qpos)
    if group_sum:
        ref_v, ref_s = ref_v.view(hkv, h // hkv, -1).sum(1), ref_s.view(hkv, h // hkv, -1).sum(1)
    q_last = q[q_len - n:].to(device)
    got = vsi.last_q_scores(q_last, k8, table[0], kv_len, scale, split=128, diagonals=diagonals,
                            group_sum=group_sum, k_scale=k_scale)
    same = vsi.last_q_scores(q_last, deq, table[0], kv_len, scale, split=128, diagonals=diagonals,
                             group_sum=group_sum)
    for g, r, o in zip(got, (ref_v, ref_s), same):
        assert ((g.cpu().double() - r).norm() / r.norm()).item() < tol
        torch.testing.assert_close(g, o, rtol=1e-5, atol=1e-6)


@cpu_only
@pytest.mark.parametrize("diagonals", DIAG_MODES)
@pytest.mark.parametrize("group_sum", [False, True])
def test_interp_last_q_scores_fp8_cache(diagonals, group_sum):
    check_last_q_fp8(8, 2, 64, 100, 230, torch.float32, 12, "cpu", 1e-4, diagonals, group_sum,
                     torch.tensor([SCALES[0]]))


@gpu
@pytest.mark.parametrize("diagonals", DIAG_MODES)
def test_gpu_last_q_scores_fp8_cache(diagonals):
    # k scale 2^-4: the dequantised keys are exact in bf16, so both caches give the same scores
    check_last_q_fp8(32, 8, 128, 3000, 2500, torch.bfloat16, 13, "cuda", 2e-2, diagonals, True,
                     torch.tensor([0.0625], device="cuda"))


@gpu
@pytest.mark.parametrize("slash_tiles", ["ranges", "blocks"])
def test_gpu_vs_index(slash_tiles):
    check_vs_index(8, 5000, 3000, 1000, 2000, seed=1, device="cuda", slash_tiles=slash_tiles)


@gpu
@pytest.mark.parametrize("select", ["torch", "radix"])
def test_gpu_vs_index_uniform_budgets(select):
    check_vs_index(8, 16384, 40000, 1000, 6096, seed=2, device="cuda", uniform=True, select=select)


@gpu
@pytest.mark.parametrize("diagonals", DIAG_MODES)
def test_gpu_last_q_scores(diagonals):
    check_last_q(8, 2, 128, 3000, 2500, 16, torch.bfloat16, seed=3, device="cuda", tol=2e-2,
                 diagonals=diagonals)


@gpu
@pytest.mark.parametrize("diagonals", ["skew", "gather"])
def test_gpu_last_q_scores_unaligned_table_row_compiles_nothing(diagonals):
    # vLLM 0.33's JIT monitor caught _lastq_pass / _lastq_skew_pass compiling in the first batch
    # whose sparse row sat in an odd row of a 2050-page table (max_model_len 131200, 64-key pages)
    def compiled():
        return sum(len(k.device_caches[torch.cuda.current_device()][0]) for k in (vsi._lastq_pass, vsi._lastq_skew_pass))

    check_last_q(16, 2, 128, 3000, 2500, 16, torch.bfloat16, seed=11, device="cuda", tol=2e-2,
                 diagonals=diagonals, group_sum=True)
    before = compiled()
    check_last_q(16, 2, 128, 3000, 2500, 16, torch.bfloat16, seed=11, device="cuda", tol=2e-2,
                 diagonals=diagonals, group_sum=True, odd_row=True)
    assert compiled() == before


@gpu
@pytest.mark.parametrize("h,hkv,d,stack", [(32, 8, 128, None), (32, 8, 128, 2), (16, 2, 128, None),
                                           (14, 2, 64, None), (24, 3, 64, None)])
@pytest.mark.parametrize("diagonals", DIAG_MODES)
def test_gpu_last_q_scores_group_sum(h, hkv, d, stack, diagonals):
    check_last_q(h, hkv, d, 3000, 2500, 16, torch.bfloat16, seed=5, device="cuda", tol=2e-2,
                 diagonals=diagonals, group_sum=True, stack=stack)


def _glue_case(dtype, device, seed=5):
    """The GPU path (run_sparse_rows_paged: estimation on the paged cache + the Triton kernel) vs
    the torch path (run_sparse_rows: torch estimation + reference on gathered K/V)."""
    from vllm_sparse_backend.settings import SparseSettings
    from vllm_sparse_backend.head_configs import HeadPattern, resolve_head
    from vllm_sparse_backend.prefill.estimate import HeadGroups
    from vllm_sparse_backend.prefill.plan import SparseRow
    from vllm_sparse_backend.prefill.run import run_sparse_rows, run_sparse_rows_paged

    gen = torch.Generator().manual_seed(seed)
    h, hkv, d, page = 8, 2, 64, 16
    geoms = [(300, 0), (150, 200)]
    key_cache, value_cache, table, _, _ = make_cache([q + c for q, c in geoms], hkv, d, page, dtype, "NHD", gen,
                                                     device)
    t = sum(q for q, _ in geoms)
    query = torch.randn(t, h, d, generator=gen).to(dtype).to(device)
    rows, tok = [], 0
    for i, (q_len, ctx) in enumerate(geoms):
        rows.append(SparseRow(i, tok, q_len, ctx))
        tok += q_len
    settings = SparseSettings(vertical_size=40, slash_size=70, last_q=32, topk_blocks=2, min_budget=64)
    heads = [resolve_head(HeadPattern(pattern=p), settings) for p in
             ["vertical_slash", "block_sparse", "a_shape", "flex_prefill"] * 2]

    def kv(r):
        return gather_paged_kv(key_cache, value_cache, table[r.row].to(device), r.ctx_len + r.q_len)

    ref = torch.full_like(query, float("nan"))
    run_recorded(SparseStats(), run_sparse_rows, query, ref, rows, kv, heads, settings, d ** -0.5, 0.0, None)
    got = torch.full_like(query, float("nan"))
    run_recorded(SparseStats(), run_sparse_rows_paged, query, got, rows, key_cache, value_cache, table.to(device),
                 HeadGroups.from_heads(heads, device), settings, d ** -0.5, 0.0, sa.sparse_prefill_attention)
    assert torch.isfinite(got).all()
    rel = (got.double() - ref.double()).norm() / ref.double().norm()
    assert rel < (1e-4 if dtype == torch.float32 else 1e-2), rel


@pytest.mark.skipif(DEV != "cpu", reason="interpreter test")
def test_interp_run_sparse_rows_with_the_kernel():
    _glue_case(torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA (and TRITON_INTERPRET unset)")
def test_gpu_run_sparse_rows_with_the_kernel():
    _glue_case(torch.bfloat16, "cuda")
