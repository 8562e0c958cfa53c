"""The skip-softmax filter of the sparse prefill kernel (``skip_below``, setting ``skip_tile_below``).

One row of 64 queries over 256 keys of context, every causal key block listed, 64-key tiles. The
keys are built so that each block's scores are known: block 0 scores 8 for every query, block 1
0, block 2 4, block 3 6.5 (the diagonal block, the queries' own, 0). Walking the blocks in order,
each block's largest weight relative to the running maximum is then e^-8, e^-4 and e^-1.5, so a
threshold decides exactly which blocks are left out; block 2 carries large values, so leaving it
out (or not) moves the output far beyond the tolerance. The kernel's output must equal float64
attention without the blocks the rule leaves out, and the rule is computed here independently
of the kernel (running maxima in float64)."""

from __future__ import annotations

import math

import pytest
import torch

from triton_setup import CUDA, INTERPRET, kernel_module

from vllm_sparse_kernels.index_format import SparseIndex

pytestmark = pytest.mark.kernels

sa = kernel_module("prefill.attention")
DEV = "cuda" if CUDA and not INTERPRET else "cpu"
DTYPE = torch.float32 if DEV == "cpu" else torch.bfloat16
D, PAGE, Q_LEN, CTX = 64, 64, 64, 256
BLOCK_SCORES = (8.0, 0.0, 4.0, 6.5)  # the context blocks' scores (the diagonal block: 0)


def _case():
    gen = torch.Generator().manual_seed(0)
    kv_len = CTX + Q_LEN
    # scores = q . k / sqrt(D): q carries sqrt(D) along dim 0 (plus noise where k is zero), k its block's score
    q = torch.randn(Q_LEN, 1, D, generator=gen) * 0.5
    q[:, :, 0] = math.sqrt(D)
    k = torch.zeros(kv_len, 1, D)
    for b, score in enumerate(BLOCK_SCORES):
        k[b * 64:(b + 1) * 64, :, 0] = score
    v = torch.randn(kv_len, 1, D, generator=gen)
    v[128:192, :, 1] = 10.0  # block 2: what leaving it out would change
    return q, k, v


def _left_out(threshold: float) -> set[int]:
    """Blocks below the diagonal that the rule leaves out, walking them in order (float64)."""
    if threshold <= 0:
        return set()
    out, running = set(), -math.inf
    for b, score in enumerate(BLOCK_SCORES):
        if running > -math.inf and score - running < math.log(threshold):
            out.add(b)
        else:
            running = max(running, score)
    return out


def _reference(q, k, v, left_out: set[int]) -> torch.Tensor:
    """float64 causal attention without the keys of the left-out blocks."""
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(D)
    pos = torch.arange(CTX + Q_LEN)
    allowed = pos[None, :] <= (CTX + torch.arange(Q_LEN))[:, None]
    for b in left_out:
        allowed &= ~((pos >= b * 64) & (pos < (b + 1) * 64))[None, :]
    p = torch.softmax(s.masked_fill(~allowed[None], float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v.double())


def _launch(q, k, v, skip_below: float) -> torch.Tensor:
    pages = (CTX + Q_LEN) // PAGE
    key_cache = k.to(DTYPE).view(pages, PAGE, 1, D).to(DEV)
    value_cache = v.to(DTYPE).view(pages, PAGE, 1, D).to(DEV)
    table = torch.arange(pages, dtype=torch.int32, device=DEV)[None]
    rows = [(0, 0, Q_LEN, CTX)]
    blocks = torch.arange(pages, dtype=torch.int32, device=DEV).view(1, 1, pages)  # every causal block, ascending
    every_block = SparseIndex(64, torch.full((1, 1), pages, dtype=torch.int32, device=DEV), blocks,
                              torch.zeros(1, 1, dtype=torch.int32, device=DEV),
                              torch.zeros(1, 1, 0, dtype=torch.int32, device=DEV))
    out = torch.full((Q_LEN, 1, D), float("nan"), dtype=DTYPE, device=DEV)
    sa.sparse_prefill_attention(q.to(DTYPE).to(DEV), key_cache, value_cache, table, rows, [every_block],
                                1.0 / math.sqrt(D), out, block_n=64, tma=False, skip_below=skip_below)
    return out.cpu().double()


def test_the_rule_leaves_out_what_the_scores_say():
    # (checks the test's own rule before the kernel is held to it)
    assert [_left_out(t) for t in (0.0, 1e-3, 0.05, 0.5)] == [set(), {1}, {1, 2}, {1, 2, 3}]


@pytest.mark.parametrize("threshold", [0.0, 1e-3, 0.05, 0.5])
def test_the_kernel_leaves_out_exactly_the_tiles_below_the_threshold(threshold):
    q, k, v = _case()
    got = _launch(q, k, v, threshold)
    tol = 1e-4 if DTYPE == torch.float32 else 2e-2
    torch.testing.assert_close(got, _reference(q, k, v, _left_out(threshold)), atol=tol, rtol=tol)
    if threshold in (1e-3, 0.05):
        # block 2 decides between these two, and moves the output well beyond the tolerance
        other = _reference(q, k, v, _left_out(0.05 if threshold == 1e-3 else 1e-3))
        assert (got - other).abs().max() > 0.1


def test_a_threshold_outside_0_to_1_is_refused():
    q, k, v = _case()
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="skip_below"):
            _launch(q, k, v, bad)
