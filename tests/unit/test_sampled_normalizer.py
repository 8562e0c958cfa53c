"""``normalizer_sample``: the last-q estimate's row sums from one key tile in N between the first
keys and the window before the queries (the torch twin the Triton pass 1 is checked against in
tests/plugin_triton/test_vs_estimate.py)."""

from __future__ import annotations

import pytest
import torch

from vllm_sparse_backend.prefill.patterns.base import last_queries_probs
from vllm_sparse_kernels.prefill.estimate_math import sampled_normalizer_region, sampled_softmax


@pytest.mark.parametrize("q0, sample, want", [(10000, 4, (1024, 5888)), (10000, 16, (1024, 5120)),
                                               (10000, 1, (0, 0)), (3000, 4, (1024, 1024)), (6143, 2, (1024, 1920))])
def test_the_sampled_region_lies_between_the_first_keys_and_the_window_on_the_tile_grid(q0, sample, want):
    # 16 x 64 = 1024: far_lo 1024; 10000 - 4096 = 5904 -> 5888 (256 grid), 5120 (1024 grid);
    # a window that reaches the first keys leaves nothing to sample
    assert sampled_normalizer_region(q0, sample) == want


def repeated_far_tiles(s: torch.Tensor, far_lo: int, far_hi: int, sample: int) -> torch.Tensor:
    """``s`` with each key tile of [far_lo, far_hi) a copy of the first tile of its group of ``sample``."""
    s = s.clone()
    for t0 in range(far_lo, far_hi, 64 * sample):
        for t in range(t0 + 64, min(t0 + 64 * sample, far_hi), 64):
            s[..., t:t + 64] = s[..., t0:t0 + 64]
    return s


def test_where_the_sample_is_exact_the_probabilities_are_the_softmax():
    gen = torch.Generator().manual_seed(0)
    kv, q0, sample = 2000, 1936, 4
    lo, hi = sampled_normalizer_region(q0, sample, first_keys=128, window=256)
    s = repeated_far_tiles(torch.randn(3, 5, kv, generator=gen) * 2, lo, hi, sample)
    got = sampled_softmax(s, torch.arange(kv), q0, sample, first_keys=128, window=256)
    torch.testing.assert_close(got, torch.softmax(s, -1))


def test_a_tile_the_sample_skips_does_not_change_the_normaliser_and_a_read_one_does():
    gen = torch.Generator().manual_seed(1)
    kv, q0, sample = 2000, 1936, 4
    lo, _ = sampled_normalizer_region(q0, sample, first_keys=128, window=256)
    s = torch.randn(2, 3, kv, generator=gen)
    base = sampled_softmax(s, torch.arange(kv), q0, sample, first_keys=128, window=256)
    skipped, read = lo + 64, lo  # the second tile of the first group is not read, its first is
    for tile, changes in ((skipped, False), (read, True)):
        t = s.clone()
        t[..., tile:tile + 64] += 3.0
        got = sampled_softmax(t, torch.arange(kv), q0, sample, first_keys=128, window=256)
        others = torch.ones(kv, dtype=torch.bool)
        others[tile:tile + 64] = False
        assert torch.allclose(got[..., others], base[..., others]) != changes


def test_a_skipped_key_above_the_read_maximum_gives_no_infinity():
    s = torch.zeros(1, 1, 2000)
    lo, _ = sampled_normalizer_region(1936, 4, first_keys=128, window=256)
    s[..., lo + 64] = 500.0  # skipped, and far above everything read
    got = sampled_softmax(s, torch.arange(2000), 1936, 4, first_keys=128, window=256)
    # every score read is 0: the sampled sum is exact (2000), the skipped key's exponent capped at 80
    assert torch.isfinite(got).all()
    assert got[0, 0, lo + 64].item() == pytest.approx(torch.exp(torch.tensor(80.0)).item() / 2000, rel=1e-5)


def test_the_last_queries_are_normalised_in_calls_of_64_each_with_its_own_window():
    """n = 128 last queries: two calls (64 each) whose windows end at their own first query. With
    the far tiles repeated on both calls' grids the sampled probabilities are the softmax."""
    gen = torch.Generator().manual_seed(2)
    kv_len, h, d, sample = 8192, 2, 8, 4
    k = torch.randn(kv_len, 1, d, generator=gen)
    for q0 in (kv_len - 64, kv_len - 128):
        lo, hi = sampled_normalizer_region(q0, sample)
        k = repeated_far_tiles(k.transpose(0, 2), lo, hi, sample).transpose(0, 2)
    q = torch.randn(128, h, d, generator=gen)
    kvh = torch.zeros(h, dtype=torch.long)
    exact, qpos = last_queries_probs(q, k, kvh, kv_len - 128, 128, 0.5)
    got, _ = last_queries_probs(q, k, kvh, kv_len - 128, 128, 0.5, normalizer_sample=sample)
    torch.testing.assert_close(got, exact)
    # and without the repeats the two calls' estimates differ from the softmax
    k2 = torch.randn(kv_len, 1, d, generator=gen)
    got2, _ = last_queries_probs(q, k2, kvh, kv_len - 128, 128, 0.5, normalizer_sample=sample)
    exact2, _ = last_queries_probs(q, k2, kvh, kv_len - 128, 128, 0.5)
    assert not torch.allclose(got2[:, :64], exact2[:, :64], atol=1e-4)
    assert not torch.allclose(got2[:, 64:], exact2[:, 64:], atol=1e-4)
