"""benchmarks/density_breakdown.py: its exact pair count of the kept lines against a brute-force
mask, and the order budget >= lines <= computed on a planted row."""

from __future__ import annotations

import pytest
import torch
from conftest import load_script

pytestmark = pytest.mark.kernels  # the script imports backend_path (triton); `make test` runs it under the interpreter

pytest.importorskip("triton", reason="the script imports benchmarks/backend_path.py, which needs triton")


@pytest.fixture(scope="module")
def db():
    return load_script("benchmarks/density_breakdown.py", "density_breakdown_bench")


def test_line_pairs_count_the_union_of_kept_columns_and_diagonals(db):
    gen = torch.Generator().manual_seed(3)
    kv_len, ctx = 97, 40
    v_keep = torch.rand(2, kv_len, generator=gen) < 0.2
    s_keep = torch.rand(2, kv_len, generator=gen) < 0.3
    p = torch.arange(kv_len)[:, None]
    j = torch.arange(kv_len)[None, :]
    causal = j <= p
    d = (p - j).clamp(min=0)
    total = slash = 0
    for g in range(2):
        on_col = v_keep[g][j].expand(kv_len, kv_len)
        on_diag = s_keep[g][d]
        rows = slice(ctx, kv_len)
        total += int(((on_col | on_diag) & causal)[rows].sum())
        slash += int((on_diag & ~on_col & causal)[rows].sum())
    assert db.line_pairs(v_keep, s_keep, kv_len - ctx, ctx) == (total, slash)


def test_row_tally_orders_budget_lines_and_computed(db):
    from vllm_sparse_backend.config import SparseSettings

    gen = torch.Generator().manual_seed(0)
    q, k, _ = db.structured_qkv(1024, 4, 2, 128, gen, dev="cpu")
    cfg = SparseSettings(vertical_size=40, slash_size=100)
    t = db.row_tally(q[512:].float(), k.float(), 512, cfg)
    assert t.causal == 2 * sum(range(513, 1025))  # two lists (one per KV head)
    assert t.lines <= t.budget < t.causal
    assert t.slash_lines <= t.lines <= t.computed <= t.causal  # the kernel computes every kept line
    assert 0 < t.tiles < t.computed  # the columns outside the slash tiles count too


def test_lines_index_is_the_estimated_index(db):
    """The tool's index from its own kept lines equals the pattern's estimate (one list per KV
    group, every head of a group alike), for block tiles, range tiles and bands."""
    from vllm_sparse_backend.config import SparseSettings
    from vllm_sparse_backend.head_configs import resolve_head
    from vllm_sparse_backend.prefill.index import count_pairs
    from vllm_sparse_backend.prefill.estimate import estimate_index

    gen = torch.Generator().manual_seed(1)
    q, k, _ = db.structured_qkv(1024, 4, 2, 128, gen, dev="cpu")
    q, k = q[384:].float(), k.float()
    for extra in ({}, {"slash_tiles": "ranges"}, {"slash_band": 64}):
        cfg = SparseSettings(vertical_size=40, slash_size=100, **extra)
        est = estimate_index(q, k, 384, [resolve_head(None, cfg)] * 4, cfg, 128 ** -0.5, 2).index
        v_keep, s_keep = db.kept_lines(q, k, 384, cfg, 2)
        ours = db.lines_index(v_keep, s_keep, 640, 384, cfg)
        for name in ("block_count", "block_index", "column_count", "column_index", "range_count", "range_start"):
            assert torch.equal(getattr(ours, name), getattr(est, name)[::2]), (extra, name)
        assert count_pairs(est, 640, 384) == 2 * count_pairs(ours, 640, 384)


def test_residual_slash_spends_no_diagonal_on_kept_columns_alone(db):
    from vllm_sparse_backend.config import SparseSettings

    gen = torch.Generator().manual_seed(0)
    q, k, _ = db.structured_qkv(2048, 4, 2, 128, gen, dev="cpu")
    cfg = SparseSettings(vertical_size=40, slash_size=200)
    plain = db.row_tally(q[1024:].float(), k.float(), 1024, cfg)
    residual = db.row_tally(q[1024:].float(), k.float(), 1024, cfg, residual=True)
    assert residual.budget == plain.budget and residual.causal == plain.causal
    assert residual.computed <= residual.causal and residual.lines <= residual.budget
    v_plain, s_plain = db.kept_lines(q[1024:].float(), k.float(), 1024, cfg, 2)
    v_res, s_res = db.kept_lines(q[1024:].float(), k.float(), 1024, cfg, 2, residual=True)
    assert torch.equal(v_plain, v_res) and not torch.equal(s_plain, s_res)  # the columns stay, diagonals move
