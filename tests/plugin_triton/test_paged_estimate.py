"""The CUDA backend's estimation step (vllm_sparse_backend.prefill.estimate.estimate_index_paged) vs the torch one.

A layer's heads carry per-head patterns (a head-config file's mix, or one default pattern); the
paged path must give exactly the SparseIndex that ``patterns.estimate_index`` gives on the row's
contiguous K, queue its work without reading anything back, and keep the heads in layer order
when several pattern groups are scattered into one index.

CPU: Triton's interpreter at small sizes (run by ``make test`` from the kernel site). GPU:
realistic sizes, bf16, where summation order may flip a few top-k / budget boundaries.
"""

from __future__ import annotations

import math

import pytest
import torch

from triton_setup import CUDA, INTERPRET, kernel_module
from kernel_helpers import assert_same_index, fp8_cache, make_row, no_host_sync

from vllm_sparse_backend.settings import SparseSettings
from vllm_sparse_backend.observability.record import run_recorded
from vllm_sparse_backend.observability.stats import SparseStats
from vllm_sparse_backend.prefill.patterns import PATTERNS, get_pattern
from vllm_sparse_backend.head_configs import HeadPattern, resolve_head
from vllm_sparse_backend.prefill.estimate import estimate_index
from vllm_sparse_backend.prefill.budgets import kv_group_share

pytestmark = pytest.mark.kernels  # `make test` runs these with triton, under its interpreter on CPU

kernel_module("prefill.estimate")
from vllm_sparse_backend.prefill.estimate import HeadGroups, estimate_index_paged  # noqa: E402

cpu_only = pytest.mark.skipif(not INTERPRET, reason="interpreter tests run only with TRITON_INTERPRET=1 (no CUDA)")


def gpu(fn):
    skip = pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA (and TRITON_INTERPRET unset)")
    return pytest.mark.gpu(skip(fn))


def _heads(patterns: list[str], settings: SparseSettings, seed: int):
    """Per-head patterns with per-head budgets that differ (as a searched file's do)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, p in enumerate(patterns):
        r = int(torch.randint(0, 3, (), generator=gen))
        values = dict(vertical_size=20 + 15 * r, slash_size=40 + 30 * r, topk_blocks=1 + r, sink_tokens=32 * r,
                      local_window=64 + 64 * r, gamma=0.85 + 0.05 * r)
        own = {f: values[f] for f in get_pattern(p).head_fields}  # an entry sets its pattern's parameters only
        out.append(resolve_head(HeadPattern(pattern=p, **own), settings))
    return out


def check(patterns, q_len, ctx_len, hkv, d, page, dtype, seed, device, settings, tol=0.0):
    group = len(patterns) // hkv
    q, k, key_cache, table = make_row(q_len, ctx_len, hkv, group, d, page, dtype, seed, device, structure=1.5)
    heads = _heads(patterns, settings, seed)
    if settings.kv_group_shared:  # uniform KV groups: every head takes its group's first head's budgets
        heads = [heads[i - i % group] for i in range(len(heads))]
    scale = 1.0 / math.sqrt(d)
    ref = estimate_index(q, k, ctx_len, heads, settings, scale)
    share = kv_group_share(heads, hkv, settings)
    groups = HeadGroups.from_heads(heads, device, share)
    q_dev = q.to(device)
    with no_host_sync(device):
        got = estimate_index_paged(q_dev, key_cache, table, ctx_len, groups, settings, scale)
    assert got.heads_per_list == share and got.index.num_heads == len(heads) // share
    # the torch path repeats each KV group's selection for its heads
    assert_same_index(got.index.repeat_heads(share), ref.index, tol)
    check.last = (ref.index, share)
    for name in {p for p in patterns if p != "flex_prefill"}:
        assert got.head_patterns[name] == ref.head_patterns[name]
    if "flex_prefill" in patterns:
        (split,) = got.splits
        assert int(split.count) == ref.head_patterns["flex_prefill/query_aware"]


# one selection per query head (per-head budgets differ); SHARED below covers kv_group_shared
SETTINGS = SparseSettings(last_q=32, keep_first_columns=3, keep_last_diagonals=4, min_budget=64, tau=0.3,
                          kv_group_shared=False)
MIXED = ["vertical_slash", "block_sparse", "a_shape", "dense", "flex_prefill", "vertical_slash", "block_sparse",
         "flex_prefill"]


@cpu_only
@pytest.mark.parametrize("q_len,ctx_len", [(130, 0), (200, 333)])
def test_interp_one_pattern_layer(q_len, ctx_len):
    check(["vertical_slash"] * 8, q_len, ctx_len, 2, 64, 16, torch.float32, 1, "cpu", SETTINGS)


@cpu_only
@pytest.mark.parametrize("q_len,ctx_len,hkv,d,page,dtype", [(130, 0, 2, 64, 16, torch.float32),
                                                            (200, 333, 1, 128, 32, torch.float16)])
def test_interp_mixed_layer(q_len, ctx_len, hkv, d, page, dtype):
    check(MIXED, q_len, ctx_len, hkv, d, page, dtype, 2, "cpu", SETTINGS)


SHARED = SETTINGS.model_copy(update={"kv_group_shared": True})


@cpu_only
@pytest.mark.parametrize("patterns,hkv", [
    (["vertical_slash"] * 8, 2), (["block_sparse"] * 6, 2),
    # one pattern per KV group (a head-config file's mix), dense and A-shape included
    (["vertical_slash"] * 2 + ["block_sparse"] * 2 + ["a_shape"] * 2 + ["dense"] * 2, 4),
    # FlexPrefill in the layer: no sharing, one selection per head
    (["vertical_slash"] * 4 + ["flex_prefill"] * 4, 2)])
def test_interp_kv_group_shared(patterns, hkv):
    check(patterns, 200, 333, hkv, 64, 16, torch.float32, 8, "cpu", SHARED)
    ref, share = check.last
    group = len(patterns) // hkv
    assert share == (1 if "flex_prefill" in patterns else group)
    if share > 1:  # the torch path gives every head of a group the same lists
        for t in (ref.block_index, ref.column_index):
            assert torch.equal(t, t[::group].repeat_interleave(group, dim=0))


@cpu_only
@pytest.mark.parametrize("settings,patterns", [
    (SETTINGS, MIXED),  # block-sparse heads among the others, one selection per head
    (SHARED, ["block_sparse"] * 4 + ["a_shape"] * 4),  # one selection per KV group (its summed mass)
    (SHARED, ["block_sparse"] * 8)])
@pytest.mark.parametrize("block_mass", [None, 0.9])
@pytest.mark.parametrize("scoring", ["antidiagonal", "sampled"])
def test_interp_mass_block_scoring(settings, patterns, block_mass, scoring):
    """block_scoring=antidiagonal / sampled: the paged path (K gathered out of the pages, one
    matmul per KV head) selects what the torch path (K per head) selects."""
    anti = settings.model_copy(update={"block_scoring": scoring, "antidiagonal_stride": 8, "block_samples": 3,
                                       "block_mass": block_mass})
    check(patterns, 200, 333, 2, 64, 16, torch.float32, 6, "cpu", anti)


@cpu_only
def test_interp_last_q_longer_than_64():
    settings = SETTINGS.model_copy(update={"last_q": 100})
    check(["vertical_slash"] * 4, 150, 90, 1, 64, 16, torch.float32, 3, "cpu", settings)


@cpu_only
@pytest.mark.parametrize("settings,patterns", [
    (SETTINGS, ["vertical_slash"] * 8),  # per-head budgets: the share is a floor on each head's
    (SHARED, ["vertical_slash"] * 8),  # one budget per group: a host int
    (SETTINGS, MIXED)])
def test_interp_budgets_growing_with_the_row(settings, patterns):
    """vertical_share / slash_share: the paged path selects what the torch path selects."""
    grown = settings.model_copy(update={"vertical_share": 0.1, "slash_share": 0.25})
    check(patterns, 200, 333, 2, 64, 16, torch.float32, 4, "cpu", grown)


def check_fp8(patterns, q_len, ctx_len, hkv, d, dtype, seed, device, settings, k_scale, deq_dtype, reference=True):
    """Estimation on an fp8 cache with the layer's k scale selects what it selects on a cache of
    the dequantised keys in ``deq_dtype`` (same kernels, K widened and scaled in registers instead
    of stored scaled), and, with ``reference``, what the torch estimator selects on the
    dequantised keys. fp32 dequantised keys are exact up to one rounding of fp8 x scale; for bf16
    / fp16 the scale is a power of two, so they are exact and every score is the same number."""
    group = len(patterns) // hkv
    q, k, key_cache, table = make_row(q_len, ctx_len, hkv, group, d, 16, torch.float32, seed, device, structure=1.5)
    k8 = fp8_cache(key_cache, k_scale)
    deq = (k8.float() * k_scale).to(deq_dtype)
    k_deq = (k / k_scale).to(torch.float8_e4m3fn).float() * k_scale
    heads = _heads(patterns, settings, seed)
    if settings.kv_group_shared:
        heads = [heads[i - i % group] for i in range(len(heads))]
    scale = 1.0 / math.sqrt(d)
    share = kv_group_share(heads, hkv, settings)
    groups = HeadGroups.from_heads(heads, device, share)
    q_dev = q.to(dtype).to(device)
    k_scale_dev = torch.tensor([k_scale], device=device)
    with no_host_sync(device):
        got = estimate_index_paged(q_dev, k8, table, ctx_len, groups, settings, scale, k_scale=k_scale_dev)
    same = estimate_index_paged(q_dev, deq, table, ctx_len, groups, settings, scale)
    assert_same_index(got.index, same.index)
    if "flex_prefill" in patterns:
        assert int(got.splits[0].count) == int(same.splits[0].count)
    if reference:
        ref = estimate_index(q_dev.float().cpu(), k_deq, ctx_len, heads, settings, scale)
        assert_same_index(got.index.repeat_heads(share), ref.index)


@cpu_only
@pytest.mark.parametrize("settings,patterns,hkv", [(SETTINGS, MIXED, 2), (SHARED, ["vertical_slash"] * 8, 2),
                                                   (SHARED, ["block_sparse"] * 4 + ["a_shape"] * 4, 2)])
def test_interp_fp8_cache_selects_what_the_dequantised_cache_selects(settings, patterns, hkv):
    # every estimator (last-q scores, pooled keys, FlexPrefill's branches), per head and shared
    check_fp8(patterns, 200, 333, hkv, 64, torch.float32, 11, "cpu", settings, 0.043, torch.float32)


@cpu_only
def test_interp_fp8_cache_fp16_queries():
    check_fp8(MIXED, 130, 100, 1, 128, torch.float16, 12, "cpu", SETTINGS, 0.0625, torch.float16, reference=False)


@gpu
@pytest.mark.parametrize("patterns,settings", [(["vertical_slash"] * 32, SHARED), (MIXED * 4, SETTINGS)])
def test_gpu_fp8_cache_selects_what_the_dequantised_cache_selects(patterns, settings):
    check_fp8(patterns, 4000, 6000, 8, 128, torch.bfloat16, 13, "cuda", settings, 0.0625, torch.bfloat16,
              reference=False)


@cpu_only
def test_head_count_mismatch_is_an_error():
    heads = [resolve_head(None, SETTINGS)] * 4
    q, _, key_cache, table = make_row(64, 0, 1, 2, 64, 16, torch.float32, 0, "cpu")
    with pytest.raises(ValueError, match="4 head patterns for 2 query heads"):
        estimate_index_paged(q, key_cache, table, 0, HeadGroups.from_heads(heads, "cpu"), SETTINGS, 0.1)


@gpu
@pytest.mark.parametrize("patterns", [["vertical_slash"] * 32, MIXED * 4])
def test_gpu_layer(patterns):
    settings = SparseSettings(min_budget=256, kv_group_shared=False)
    check(patterns, 4096 + 77, 9000, 8, 128, 16, torch.bfloat16, 5, "cuda", settings, tol=0.02)


@gpu
def test_gpu_layer_kv_group_shared():
    check(["vertical_slash"] * 16 + ["block_sparse"] * 16, 4096 + 77, 9000, 8, 128, 16, torch.bfloat16, 5, "cuda",
          SparseSettings(kv_group_shared=True), tol=0.02)


def test_pattern_names_cover_the_enum():
    assert set(MIXED) == set(PATTERNS)


def check_density_fallback(max_density, expect_dense, device, dtype, tol, sample_every=0):
    """With ``estimated_dense_rows="kernel"``, rows whose estimated index is denser than
    max_density run the kernel's dense mode, flagged on the device without a host sync
    (dense_row, the FlashAttention fallback, is then only for rows the budgets rule out); the
    others are computed sparse. Both match the float64 reference of
    what they ran, and the stats name the fallback once the flags are read. With
    ``sample_every`` = 1 the forward is a timed sample whose pair counts and flags are read back
    later, still without a sync in the forward: the stats are exact once drained."""
    from vllm_sparse_kernels.reference.dense import masked_attention_f64
    from vllm_sparse_kernels.reference.index import index_to_dense_mask
    from vllm_sparse_backend.prefill.index import count_pairs
    from vllm_sparse_backend.prefill.plan import SparseRow
    from vllm_sparse_kernels.index_format import causal_pairs
    from vllm_sparse_backend.prefill.route import DenseReason
    from vllm_sparse_backend.prefill.run import run_sparse_rows_paged
    from vllm_sparse_kernels.prefill.attention import sparse_prefill_attention

    settings = SETTINGS.model_copy(update={"max_density": max_density, "vertical_size": 8, "slash_size": 16,
                                           "estimated_dense_rows": "kernel"})
    q_len, ctx, hkv, group, d = 200, 300, 2, 2, 64
    q, k, key_cache, table = make_row(q_len, ctx, hkv, group, d, 16, dtype, 7, device)
    v = torch.randn_like(k)
    value_cache = torch.full_like(key_cache, float("nan"))  # V on the same pages as K:
    for pos in range(ctx + q_len):
        value_cache[int(table[pos // 16]), pos % 16] = v[pos].to(device)
    heads = [resolve_head(None, settings)] * (hkv * group)
    q_dev = q.to(device)
    out = torch.full_like(q_dev, float("nan"))
    sent_dense = []
    row = SparseRow(0, 0, q_len, ctx)
    used = []  # the index the forward ran

    def kernel(*args, **kwargs):
        used.append(args[5][0])
        return sparse_prefill_attention(*args, **kwargs)

    stats = SparseStats()
    stats.timer.every = sample_every  # with sample_every 1, this forward is sampled
    before = stats.as_dict()
    groups = HeadGroups.from_heads(heads, device)
    with no_host_sync(device):
        sent_dense = run_recorded(stats, run_sparse_rows_paged, q_dev, out, [row], key_cache, value_cache, table[None],
                                  groups, settings, d ** -0.5, 0.0, kernel, density_fallback=True)
    assert sent_dense == []  # the budgets (24 keys of ~400 visible: 0.06) allow max_density 0.1
    idx = estimate_index(q.float(), k.float(), ctx, heads, settings, d ** -0.5).index
    if expect_dense:
        mask = torch.ones(q_len, ctx + q_len, dtype=torch.bool).tril(ctx)[None].expand(hkv * group, -1, -1)
    else:
        mask = index_to_dense_mask(idx, q_len, ctx)
    ref = masked_attention_f64(q, k, v, mask, d ** -0.5)
    assert ((out.cpu().double() - ref).norm() / ref.norm()) < tol
    stats.flush_deferred()
    after = stats.as_dict()
    reasons = [d["dense_reasons"].get(DenseReason.ESTIMATED_DENSITY, 0) for d in (before, after)]
    assert reasons[1] - reasons[0] == int(expect_dense)
    if sample_every:  # measured: all causal pairs when run dense, else the pairs of the index it ran
        causal = causal_pairs(q_len, ctx, hkv * group)
        assert after["causal_pairs"] - before["causal_pairs"] == causal
        assert after["computed_pairs"] - before["computed_pairs"] == \
            (causal if expect_dense else count_pairs(used[0], q_len, ctx))


@cpu_only
@pytest.mark.parametrize("max_density,expect_dense", [(1.0, False), (0.1, True)])
def test_density_fallback(max_density, expect_dense):
    check_density_fallback(max_density, expect_dense, "cpu", torch.float32, 1e-4)


@cpu_only
@pytest.mark.parametrize("max_density,to_flash", [(1.0, False), (0.1, True)])
def test_estimated_dense_rows_go_to_flash_attention(max_density, to_flash):
    """``estimated_dense_rows="flash"``: the flags are read on the host and a row
    whose estimated index is too dense is returned to the caller (FlashAttention in the backend),
    counted as a dense row at once; the kernel never sees it. A row sparse enough runs the kernel."""
    from vllm_sparse_backend.prefill.plan import SparseRow
    from vllm_sparse_backend.prefill.route import DenseReason
    from vllm_sparse_backend.prefill.run import run_sparse_rows_paged

    settings = SETTINGS.model_copy(update={"max_density": max_density, "vertical_size": 8, "slash_size": 16,
                                           "estimated_dense_rows": "flash"})
    q_len, ctx, hkv, group, d = 200, 300, 2, 2, 64
    q, k, key_cache, table = make_row(q_len, ctx, hkv, group, d, 16, torch.float32, 7, "cpu")
    heads = [resolve_head(None, settings)] * (hkv * group)
    rows = [SparseRow(0, 0, q_len, ctx)]
    kernel_rows = []
    stats = SparseStats()
    sent_dense = run_recorded(stats, run_sparse_rows_paged, q, torch.zeros_like(q), rows, key_cache, key_cache,
                              table[None], HeadGroups.from_heads(heads, "cpu"), settings, d ** -0.5, 0.0,
                              lambda *args, **kw: kernel_rows.append(args[4]), density_fallback=True)
    assert sent_dense == (rows if to_flash else [])
    assert kernel_rows == ([] if to_flash else [rows])
    assert stats.as_dict()["dense_reasons"].get(DenseReason.ESTIMATED_DENSITY, 0) == int(to_flash)


@cpu_only
def test_auto_reads_the_flags_only_after_a_call_that_had_flagged_rows():
    """``estimated_dense_rows="auto"`` with the layer's LayerDensityHistory: the first call reads its
    flags on the host (nothing known yet); after a call without flagged rows the next one leaves
    the flags on the device (the kernel gets them and runs a flagged row in its dense mode, none
    returned), copies whether any was flagged back, and the call after that reads again."""
    from vllm_sparse_backend.prefill.plan import SparseRow
    from vllm_sparse_backend.prefill.cost import LayerDensityHistory
    from vllm_sparse_backend.prefill.run import run_sparse_rows_paged

    q_len, ctx, hkv, group, d = 200, 300, 2, 2, 64
    q, k, key_cache, table = make_row(q_len, ctx, hkv, group, d, 16, torch.float32, 7, "cpu")
    rows = [SparseRow(0, 0, q_len, ctx)]  # its estimated index covers 0.36 of the causal pairs
    history = LayerDensityHistory()

    def call(max_density):  # (the cost model, off here, would send a row this small dense)
        settings = SETTINGS.model_copy(update={"max_density": max_density, "vertical_size": 2, "slash_size": 2,
                                               "estimated_dense_rows": "auto", "cost_model": False})
        heads = [resolve_head(None, settings)] * (hkv * group)
        launched = []
        sent_dense = run_recorded(SparseStats(), run_sparse_rows_paged, q, torch.zeros_like(q), rows, key_cache,
                                  key_cache, table[None], HeadGroups.from_heads(heads, "cpu"), settings, d ** -0.5,
                                  0.0, lambda *args, **kw: launched.append(kw.get("whole_rows")),
                                  density_fallback=True, history=history)
        whole = [None if w is None else w.tolist() for w in launched]
        return sent_dense, whole

    assert history.read_on_host()
    assert call(0.5) == ([], [None])  # read: nothing flagged, the kernel runs the row sparse
    assert not history.read_on_host()
    assert call(0.1) == ([], [[True]])  # not read: the kernel's dense mode takes the flagged row
    assert history.read_on_host()  # the copied-back flag says a row was flagged
    assert call(0.1) == (rows, [])  # read: the flagged row is returned (FlashAttention computes it)
    assert history.read_on_host()
    assert call(0.5) == ([], [None])
    assert not history.read_on_host()


@cpu_only
def test_cost_model_sends_rows_dense_before_estimating_them():
    """``cost_model``: a row whose predicted sparse cost (the layer's measured expansion times
    its budget density, the estimation, the fixed cost per row) is not below FlashAttention's is
    returned without being estimated or launched, under its own dense reason; one the model
    predicts to win runs the kernel; with ``cost_model`` off only max_density decides; and one
    gated row in PROBE_EVERY is estimated anyway."""
    from vllm_sparse_backend.prefill.cost import LayerDensityHistory, RowCost
    from vllm_sparse_backend.prefill.plan import SparseRow
    from vllm_sparse_backend.prefill import run as run_mod
    from vllm_sparse_backend.prefill.route import DenseReason

    q_len, ctx, hkv, group, d = 200, 300, 2, 2, 64
    q, k, key_cache, table = make_row(q_len, ctx, hkv, group, d, 16, torch.float32, 7, "cpu")
    rows = [SparseRow(0, 0, q_len, ctx)]  # budgets: 24 keys of ~400 visible (0.06); computed about 0.65
    free = RowCost(estimate_key=0.0, row_overhead=0.0)  # only the pairs count

    def call(history, row_cost=free, cost_model=True):
        settings = SETTINGS.model_copy(update={"max_density": 0.9, "vertical_size": 8, "slash_size": 16,
                                               "block_size": 16, "estimated_dense_rows": "flash",
                                               "cost_model": cost_model})
        heads = [resolve_head(None, settings)] * (hkv * group)
        launched, stats = [], SparseStats()
        sent = run_recorded(stats, run_mod.run_sparse_rows_paged, q, torch.zeros_like(q), rows, key_cache, key_cache,
                            table[None], HeadGroups.from_heads(heads, "cpu"), settings, d ** -0.5, 0.0,
                            lambda *args, **kw: launched.append(args[4]),
                            density_fallback=True, history=history, row_cost=row_cost)
        return sent, launched, stats.as_dict()["dense_reasons"].get(DenseReason.COST_MODEL, 0)

    fresh = LayerDensityHistory()
    assert call(fresh) == ([], [rows], 0)  # nothing measured: predicted = budgets (0.06), sparse wins
    assert fresh.expansion is not None  # the estimate was measured on the way
    assert call(LayerDensityHistory(), row_cost=RowCost()) == (rows, [], 1)  # the fixed cost outweighs 200 queries
    dense_layer = LayerDensityHistory()
    dense_layer.observed([0.95], [0.05], [1], 0.99)  # this layer computes 19x its budgets: every pair
    assert call(dense_layer) == (rows, [], 1)
    assert call(dense_layer, cost_model=False) == ([], [rows], 0)
    probed = LayerDensityHistory()
    probed.observed([0.95], [0.05], [1], 0.99)
    results = [call(probed) for _ in range(LayerDensityHistory.PROBE_EVERY)]
    assert all(r == (rows, [], 1) for r in results[:-1])
    assert results[-1] == ([], [rows], 0)  # the probe: estimated and launched
    assert probed.expansion != pytest.approx(19.0)  # and measured again


@gpu
def test_gpu_density_history_copies_back_without_waiting():
    """On CUDA the densities come back through pinned memory and an event: not read until the
    GPU has written them, and then read without a sync."""
    from vllm_sparse_backend.prefill.cost import LayerDensityHistory

    for densities, expect in (([0.1, 0.2], False), ([0.1, 0.9], True)):
        history = LayerDensityHistory()
        dens = torch.tensor(densities, device="cuda")  # (a pageable upload would wait for the sleep)
        history.watch(dens, [0.1, 0.1], [1, 1], 0.5)  # the first watch allocates the pinned buffer (may sync)
        torch.cuda.synchronize()
        history.observed([0.6 if not expect else 0.1], [0.2], [1], 0.5)
        torch.cuda._sleep(200_000_000)  # the copy back waits behind this on the stream
        history.watch(dens, [0.1, 0.1], [1, 1], 0.5)
        assert history.read_on_host() is (not expect)  # not yet copied back: the older answer
        torch.cuda.synchronize()
        assert history.read_on_host() is expect
        assert history.expansion == pytest.approx(sum(densities) / 0.2)


@cpu_only
@pytest.mark.parametrize("mode,variants", [("flash", [False]), ("kernel", [False, True]),
                                           ("auto", [False, True])])
def test_worst_case_steps_compile_the_kernels_dense_mode_where_it_can_run(mode, variants):
    """The profiling-run claim launches the kernel variants serving will: with rows flagged on
    the device (``estimated_dense_rows`` kernel / auto) also the one that takes the flags, so
    that it compiles at start-up, not in the first request that has a flagged row."""
    from vllm_sparse_backend.prefill.claim import run_worst_case_steps
    from vllm_sparse_kernels.prefill.attention import sparse_prefill_attention

    settings = SETTINGS.model_copy(update={"max_density": 0.9, "estimated_dense_rows": mode})
    heads = [resolve_head(None, settings)] * 4
    q = torch.randn(150, 4, 64)
    out = torch.full_like(q, float("nan"))
    launched = []

    def kernel(*args, **kwargs):
        launched.append(kwargs.get("whole_rows") is not None)  # the variant that reads the flags
        return sparse_prefill_attention(*args, **kwargs)

    steps = run_worst_case_steps(q, out, 2, 500, HeadGroups.from_heads(heads, "cpu"), settings, 0.125, 0.0, kernel)
    assert launched == variants * (len(steps) + 1) and torch.isfinite(out).all()  # + the compile row


@gpu
def test_gpu_density_fallback():
    check_density_fallback(0.1, True, "cuda", torch.bfloat16, 1e-2)


@gpu
@pytest.mark.parametrize("max_density,expect_dense", [(1.0, False), (0.1, True)])
def test_gpu_sampled_forward_reads_stats_back_later(max_density, expect_dense):
    check_density_fallback(max_density, expect_dense, "cuda", torch.bfloat16, 1e-2, sample_every=1)


@cpu_only
def test_kv_group_shared_rows_match_float64_reference(tmp_path):
    """Shared selections through the whole GPU path (paged estimation, one list per KV head, the
    kernel stacking or repeating the lists) give float64 attention over the torch path's
    per-head index, and the stats count every query head's pairs."""
    from vllm_sparse_kernels.reference.dense import masked_attention_f64
    from vllm_sparse_backend.prefill.index import count_pairs
    from vllm_sparse_kernels.reference.index import index_to_dense_mask
    from vllm_sparse_backend.prefill.plan import SparseRow
    from vllm_sparse_backend.prefill.run import run_sparse_rows_paged
    from vllm_sparse_kernels.prefill.attention import sparse_prefill_attention

    stats = SparseStats()
    settings = SHARED.model_copy(update={"max_density": 1.0, "vertical_size": 8, "slash_size": 16,
                                         "stats_file": str(tmp_path / "stats.json")})  # exact pair counts
    for d in (64, 128):  # 64: lists repeated per head; 128: the group's heads stacked in one program
        q_len, ctx, hkv, group = 200, 300, 2, 4
        q, k, key_cache, table = make_row(q_len, ctx, hkv, group, d, 16, torch.float32, 9, "cpu", structure=1.5)
        v = torch.randn_like(k)
        value_cache = torch.full_like(key_cache, float("nan"))
        for pos in range(ctx + q_len):
            value_cache[int(table[pos // 16]), pos % 16] = v[pos]
        heads = [resolve_head(None, settings)] * (hkv * group)
        out = torch.full_like(q, float("nan"))
        before = stats.as_dict()
        run_recorded(stats, run_sparse_rows_paged, q, out, [SparseRow(0, 0, q_len, ctx)], key_cache, value_cache,
                     table[None], HeadGroups.from_heads(heads, "cpu", group), settings, d ** -0.5, 0.0,
                     sparse_prefill_attention, stats_file=settings.observability.stats_file)
        idx = estimate_index(q, k, ctx, heads, settings, d ** -0.5).index
        assert idx.num_heads == hkv * group
        ref = masked_attention_f64(q, k, v, index_to_dense_mask(idx, q_len, ctx), d ** -0.5)
        assert ((out.double() - ref).norm() / ref.norm()) < 1e-4
        assert stats.as_dict()["computed_pairs"] - before["computed_pairs"] == count_pairs(idx, q_len, ctx)


def test_index_density_bounds_count_pairs():
    from vllm_sparse_backend.prefill.index import count_pairs, index_density
    settings = SETTINGS.model_copy(update={"vertical_size": 8, "slash_size": 16})
    q, k, _, _ = make_row(200, 300, 2, 2, 64, 16, torch.float32, 7, "cpu")
    ix = estimate_index(q, k, 300, [resolve_head(None, settings)] * 4, settings, 0.125).index
    causal = 4 * (200 * 300 + 200 * 201 // 2)
    exact = count_pairs(ix, 200, 300) / causal
    bound = float(index_density(ix, 200, 300))
    assert exact <= bound <= 1.0 and bound < 2 * exact


def _scratch_shapes(est):
    ix = est.index
    return [tuple(t.shape) for t in (ix.block_count, ix.block_index, ix.column_count, ix.column_index)]


@cpu_only
def test_index_widths_do_not_depend_on_the_data():
    """The profiling-run claim (prefill.claim.run_worst_case_steps) runs the path on a stand-in
    cache of zeros; it measures the real scratch only if every buffer's size follows from the
    row's lengths and the budgets, never from K's values. Random structured K vs zeros."""
    q_len, ctx, hkv, d = 200, 333, 2, 64
    heads = _heads(MIXED, SETTINGS, 4)
    groups = HeadGroups.from_heads(heads, "cpu")
    q, _, key_cache, table = make_row(q_len, ctx, hkv, len(MIXED) // hkv, d, 16, torch.float32, 4, "cpu",
                                      structure=1.5)
    real = estimate_index_paged(q, key_cache, table, ctx, groups, SETTINGS, d ** -0.5)
    zeros = torch.zeros(1, 16, hkv, d)
    fake = estimate_index_paged(q, zeros, torch.zeros_like(table), ctx, groups, SETTINGS, d ** -0.5)
    assert _scratch_shapes(real) == _scratch_shapes(fake)


@cpu_only
@pytest.mark.parametrize("page_size", [16, 64])
def test_worst_case_steps_take_the_whole_query(page_size):
    # page_size: the serving cache's (the backend passes vLLM's block size, so that the variants
    # serving uses, e.g. the TMA one of 64-key pages, compile in the profiling run)
    from vllm_sparse_backend.prefill.plan import SparseRow
    from vllm_sparse_backend.prefill.claim import compile_row, run_worst_case_steps
    from vllm_sparse_kernels.prefill.attention import sparse_prefill_attention

    heads = [resolve_head(None, SETTINGS)] * 4
    q = torch.randn(150, 4, 64)
    out = torch.full_like(q, float("nan"))
    # room for 2 rows of >= 64 queries; max_density 1: one launch per step (no dense-mode variant)
    settings = SETTINGS.model_copy(update={"min_sparse_query_len": 64, "max_density": 1.0})
    launched = []

    def kernel(*args, **kwargs):
        launched.append(list(args[4]))
        return sparse_prefill_attention(*args, **kwargs)

    steps = run_worst_case_steps(q, out, 2, 500, HeadGroups.from_heads(heads, "cpu"), settings, 0.125, 0.0,
                                 kernel, page_size=page_size)
    assert steps == [[SparseRow(0, 0, 150, 350)], [SparseRow(0, 0, 75, 425), SparseRow(1, 75, 75, 425)],
                     [SparseRow(0, 0, 86, 414), SparseRow(1, 86, 64, 436)],
                     [SparseRow(0, 0, 64, 436), SparseRow(1, 64, 86, 414)]]
    # each step's rows in one launch, as run_sparse_rows_paged does; then the short compile row
    assert launched == steps + [[compile_row(150, 500, 64)]] == steps + [[SparseRow(0, 0, 64, 64)]]
    assert torch.isfinite(out).all()  # all of the rows' outputs written


def test_compile_row_is_short_whatever_the_max_model_len():
    """The profiling run's last row compiles the short-context variants (the last-q pass's skew
    diagonals, vs_index.last_q_scores): its context stays far below where that pass switches to
    gathering, even when max_model_len is 1M, and it fits any chunk and context."""
    from vllm_sparse_backend.prefill.claim import compile_row
    from vllm_sparse_kernels.prefill import vs_index

    for q_len, kv_len, min_q in [(16384, 1048704, 4096), (8192, 131200, 512), (150, 500, 64), (40, 60, 4096),
                                 (1, 1, 1)]:
        row = compile_row(q_len, kv_len, min_q)
        assert 1 <= row.q_len <= q_len and 0 <= row.ctx_len and row.ctx_len + row.q_len <= kv_len
        assert row.ctx_len + row.q_len <= 2 * max(min_q, 64)
        # skew while 32 slabs (one per query head of a 32-head model) of the row fit
        assert 32 * 64 * (row.ctx_len + row.q_len + 63) * 4 <= vs_index.SKEW_SLAB_BYTES
    assert 32 * 64 * (1048704 + 63) * 4 > vs_index.SKEW_SLAB_BYTES  # the claim's 1M rows gather


def test_worst_case_steps_split_the_chunk_into_the_most_rows_it_holds():
    from vllm_sparse_backend.prefill.claim import MAX_CLAIMED_ROWS, worst_case_steps

    steps = worst_case_steps(16384, 131200, 4096)
    for rows in steps:  # one chunk, every row at the longest context, each in its own table row
        assert sum(r.q_len for r in rows) == 16384 and min(r.q_len for r in rows) >= 4096
        assert [r.row for r in rows] == list(range(len(rows)))
        assert [r.tok_start for r in rows] == [sum(x.q_len for x in rows[:i]) for i in range(len(rows))]
        assert all(r.ctx_len + r.q_len == 131200 for r in rows)
    assert [[r.q_len for r in rows] for rows in steps] == [
        [16384], [8192, 8192], [12288, 4096], [4096, 12288],
        [5461, 5461, 5462], [8192, 4096, 4096], [4096, 4096, 8192], [4096] * 4]
    assert max(len(rows) for rows in worst_case_steps(16384, 131200, 1)) == MAX_CLAIMED_ROWS
    assert worst_case_steps(100, 60, 4096) == worst_case_steps(60, 60, 60)[:1]  # a chunk past the context


@cpu_only
def test_worst_case_steps_of_an_fp8_layer():
    # the profiling-run claim of an fp8 layer runs the fp8 (scaled) variants on an fp8 stand-in
    from vllm_sparse_backend.prefill.plan import SparseRow
    from vllm_sparse_backend.prefill.claim import run_worst_case_steps
    from vllm_sparse_kernels.prefill.attention import sparse_prefill_attention

    heads = [resolve_head(None, SETTINGS)] * 4
    q = torch.randn(150, 4, 64)
    out = torch.full_like(q, float("nan"))
    seen = []

    def kernel(*args, **kwargs):
        seen.append((args[1].dtype, kwargs.get("k_scale"), kwargs.get("v_scale")))
        return sparse_prefill_attention(*args, **kwargs)

    steps = run_worst_case_steps(q, out, 2, 500, HeadGroups.from_heads(heads, "cpu"), SETTINGS, 0.125, 0.0, kernel,
                                 kv_dtype=torch.float8_e4m3fn)
    assert steps == [[SparseRow(0, 0, 150, 350)]] and torch.isfinite(out).all()
    assert seen  # (two launches where the kernel's dense mode can run: see the next test)
    for dtype, k_scale, v_scale in seen:
        assert dtype == torch.float8_e4m3fn and float(k_scale) == float(v_scale) == 1.0


def gpu_peak_bytes(fn) -> int:
    """Peak CUDA memory ``fn`` allocates above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@gpu
@pytest.mark.parametrize("patterns", [["vertical_slash"] * 32, ["flex_prefill"] * 32, MIXED * 4])
def test_gpu_worst_case_steps_peak_covers_a_real_row(patterns):
    """What the profiling run sees must be at least what a real row of that size allocates."""
    from vllm_sparse_backend.prefill.plan import SparseRow
    from vllm_sparse_backend.prefill.run import run_sparse_rows_paged
    from vllm_sparse_backend.prefill.claim import run_worst_case_steps
    from vllm_sparse_kernels.prefill.attention import sparse_prefill_attention

    settings = SparseSettings()
    q_len, ctx, hkv, d = 8192, 24576, 8, 128
    q, _, key_cache, table = make_row(q_len, ctx, hkv, 4, d, 16, torch.bfloat16, 6, "cuda", structure=1.5)
    q = q.cuda()
    value_cache = torch.randn_like(key_cache)
    groups = HeadGroups.from_heads(_heads(patterns, settings, 6), "cuda")
    out = torch.empty_like(q)

    real = gpu_peak_bytes(lambda: run_recorded(
        SparseStats.measuring_only(), run_sparse_rows_paged, q, out, [SparseRow(0, 0, q_len, ctx)], key_cache,
        value_cache, table[None], groups, settings, d ** -0.5, 0.0, sparse_prefill_attention))  # a sampled forward: pairs counted too
    claim = gpu_peak_bytes(lambda: run_worst_case_steps(
        q, out, hkv, ctx + q_len, groups, settings, d ** -0.5, 0.0, sparse_prefill_attention))
    assert claim >= real > 0


@gpu
@pytest.mark.parametrize("budgets", [{}, {"vertical_size": 32768, "slash_size": 32768, "max_density": 1.0}])
def test_gpu_worst_case_steps_peak_covers_a_real_two_row_step(budgets):
    """A step of two unequal sparse rows keeps both rows' index lists until its one kernel
    launch; the claim's split steps must cover it (one row of the whole chunk did not: 1.8x at
    budgets near the context, the scratch_memory study in git history)."""
    from vllm_sparse_backend.prefill.plan import SparseRow
    from vllm_sparse_backend.prefill.run import run_sparse_rows_paged
    from vllm_sparse_backend.prefill.claim import run_worst_case_steps
    from vllm_sparse_kernels.prefill.attention import sparse_prefill_attention

    settings = SparseSettings(**budgets)
    q_len, ctx, hkv, d = 12288, 24576, 8, 128
    q, _, key_cache, table = make_row(q_len, ctx, hkv, 4, d, 16, torch.bfloat16, 6, "cuda", structure=1.5)
    q = q.cuda()
    value_cache = torch.randn_like(key_cache)
    groups = HeadGroups.from_heads([resolve_head(None, settings)] * 32, "cuda")
    out = torch.empty_like(q)
    rows = [SparseRow(0, 0, 7168, ctx + q_len - 7168), SparseRow(1, 7168, 5120, 30000 - 5120)]

    real = gpu_peak_bytes(lambda: run_recorded(
        SparseStats.measuring_only(), run_sparse_rows_paged, q, out, rows, key_cache, value_cache,
        torch.stack([table, table]), groups, settings, d ** -0.5, 0.0, sparse_prefill_attention,
        density_fallback=True))
    claim = gpu_peak_bytes(lambda: run_worst_case_steps(
        q, out, hkv, ctx + q_len, groups, settings, d ** -0.5, 0.0, sparse_prefill_attention))
    assert claim >= real > 0


@gpu
def test_gpu_claim_at_a_long_max_model_len_compiles_what_short_rows_run():
    """At a 1M max_model_len the claim's rows sum diagonals by gathering (the skew slabs would
    not fit); its compile row must leave nothing for an ordinary row to compile in a request
    (vLLM's JIT monitor flagged _lastq_skew_pass and _skew_colsum in the first 32K request)."""
    from vllm_sparse_backend.prefill.plan import SparseRow
    from vllm_sparse_backend.prefill.run import run_sparse_rows_paged
    from vllm_sparse_backend.prefill.claim import run_worst_case_steps
    from vllm_sparse_kernels.prefill import vs_index as vsi
    from vllm_sparse_kernels.prefill.attention import sparse_prefill_attention

    settings = SparseSettings()
    hkv, d, chunk, kv_len = 8, 128, 4096, 1 << 20
    groups = HeadGroups.from_heads([resolve_head(None, settings)] * 32, "cuda")
    q = torch.randn(chunk, 32, d, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    run_worst_case_steps(q, out, hkv, kv_len, groups, settings, d ** -0.5, 0.0, sparse_prefill_attention)
    kernels = [getattr(vsi, name) for name in dir(vsi) if hasattr(getattr(vsi, name), "device_caches")]

    def compiled():
        return {k.__name__: len(k.device_caches[torch.cuda.current_device()][0]) for k in kernels}

    before = compiled()
    ctx = 28672
    qr, _, key_cache, table = make_row(chunk, ctx, hkv, 4, d, 16, torch.bfloat16, 6, "cuda", structure=1.5)
    run_recorded(SparseStats(), run_sparse_rows_paged, qr.cuda(), torch.empty_like(qr.cuda()),
                 [SparseRow(0, 0, chunk, ctx)], key_cache, torch.randn_like(key_cache), table[None], groups, settings,
                 d ** -0.5, 0.0, sparse_prefill_attention, density_fallback=True)
    torch.cuda.synchronize()
    assert compiled() == before


@cpu_only
def test_rows_the_budgets_cannot_make_sparse_skip_estimation():
    """Default budgets (1000 + 1000 keys per query) on a 4K pure prefill: at best 2.4x more than
    max_density allows, so the row goes to the dense kernel before anything is estimated."""
    from vllm_sparse_backend.prefill.plan import SparseRow
    from vllm_sparse_backend.prefill.run import run_sparse_rows_paged

    settings = SparseSettings()
    q = torch.randn(4096, 2, 64)
    heads = HeadGroups.from_heads([resolve_head(None, settings)] * 2, "cpu")
    launched = []
    empty = torch.zeros(0, 16, 1, 64)  # estimation would fail on this cache: it must not run
    sent_dense = run_recorded(SparseStats(), run_sparse_rows_paged, q, torch.empty_like(q), [SparseRow(0, 0, 4096, 0)],
                              empty, empty, torch.zeros(1, 256, dtype=torch.int32), heads, settings, 0.125, 0.0,
                              lambda *a: launched.append(a), density_fallback=True)
    assert sent_dense == [SparseRow(0, 0, 4096, 0)] and not launched


@cpu_only
@pytest.mark.parametrize("settings,ctx_len,patterns", [
    (SHARED, 333, ["vertical_slash"] * 8),  # one budget per group; 333 % 64: bands start mid-block
    (SHARED, 320, ["vertical_slash"] * 8),  # context a multiple of 64: aligned bands
    (SETTINGS, 333, ["vertical_slash"] * 8),  # per-head budgets: band counts as a tensor
    (SETTINGS, 0, MIXED)])
def test_interp_slash_bands(settings, ctx_len, patterns):
    """slash_band: the paged path keeps the bands the torch path keeps."""
    check(patterns, 200, ctx_len, 2, 64, 16, torch.float32, 5, "cpu", settings.model_copy(update={"slash_band": 64}))
