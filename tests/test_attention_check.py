"""The attention check against brute force: recall, output error and density of a sparse index
on small synthetic Q/K/V (float64 full attention with explicit masks), and the capture from a
tiny random transformers model (our dense attention equals the model's own layer output)."""

from __future__ import annotations

import pytest
import torch
from conftest import causal_mask, masked_attention_f64

from vllm_sparse_backend.config import PatternName, SparseSettings
from vllm_sparse_backend.evaluation import attention_check as ac
from vllm_sparse_backend.evaluation.variants import PRESETS, Variant, parse_variant, searched_variant
from vllm_sparse_backend.head_configs import resolve_head
from vllm_sparse_backend.index import build_index, causal_block_mask, index_to_dense_mask
from vllm_sparse_backend.patterns import estimate_index
from vllm_sparse_backend.reference import causal_pairs

N, H, HKV, D = 600, 4, 2, 16
SCALE = D ** -0.5


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(N, H, D, generator=g) * 2
    k = torch.randn(N, HKV, D, generator=g) * 2
    k[:5] += 3 * q.mean((0, 1))  # a few sink-like keys that many queries like
    v = torch.randn(N, HKV, D, generator=g)
    return q, k, v


def _mixed_index(q, k):
    """Vertical-slash, A-shape, block-sparse and FlexPrefill heads with small budgets."""
    s = SparseSettings(block_size=16, flex_block_size=16, vertical_size=8, slash_size=6, last_q=16,
                       keep_first_columns=2, keep_last_diagonals=2, sink_tokens=16, local_window=48,
                       topk_blocks=4, min_budget=16, gamma=0.7)
    heads = [resolve_head(None, s.model_copy(update={"default_pattern": PatternName(p)}))
             for p in ("vertical_slash", "a_shape", "block_sparse", "flex_prefill")]
    return estimate_index(q, k, 0, heads, s, SCALE).index


def _brute_force(q, k, v, index, rows):
    """float64 recall, output error and density with full n x n matrices and explicit masks."""
    mask = index_to_dense_mask(index, N, 0)  # [H, N, N]
    full = causal_mask(H, N, 0)
    kvh = torch.arange(H) // (H // HKV)
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()[:, kvh]) * SCALE
    p = torch.softmax(s.masked_fill(~full, float("-inf")), -1)
    recall = (p * mask).sum(-1)[:, rows]  # [H, R]
    dense = masked_attention_f64(q, k, v, full, SCALE)[rows]
    sparse = masked_attention_f64(q, k, v, mask, SCALE)[rows]
    err = float((sparse - dense).norm() / dense.norm())
    err_head = ((sparse - dense).norm(dim=(0, 2)) / dense.norm(dim=(0, 2)))
    density = mask.sum().item() / causal_pairs(N, 0, H)
    return recall, err, err_head, density


def test_allowed_keys_is_the_index_mask():
    q, k, _ = _qkv()
    index = _mixed_index(q, k)
    rows = torch.tensor([0, 1, 15, 16, 100, 257, 513, N - 1])
    assert torch.equal(ac.allowed_keys(index, rows, N), index_to_dense_mask(index, N, 0)[:, rows])


@pytest.mark.parametrize("rows, tile", [(None, 64), (None, 7), (37, 5)])
def test_selection_stats_match_brute_force(rows, tile):
    q, k, v = _qkv(1)
    index = _mixed_index(q, k)
    rows_t = torch.arange(N) if rows is None else ac.sample_rows(N, rows, seed=3)
    (st,), _ = ac.selection_stats(q, k, v, SCALE, [index], rows_t, tile=tile)
    recall, err, err_head, _ = _brute_force(q, k, v, index, rows_t)
    assert torch.allclose(st.recall_per_head, recall.mean(-1), atol=1e-5)
    assert st.error == pytest.approx(err, rel=1e-4)
    assert torch.allclose(st.error_per_head, err_head, rtol=1e-4, atol=1e-6)
    # small budgets: every head loses some mass (not a trivial case), and not everything
    assert 0.2 < float(recall.mean(-1).min()) and float(recall.mean(-1).max()) < 0.99


def test_dense_index_has_full_recall_and_no_error_and_capture_check():
    q, k, v = _qkv(2)
    dense = build_index(causal_block_mask(N, 0, 32)[None].expand(H, -1, -1).clone(), 32, N, 0)
    rows = torch.arange(N)
    full = causal_mask(H, N, 0)
    model_out = masked_attention_f64(q, k, v, full, SCALE).float()
    (st,), diff = ac.selection_stats(q, k, v, SCALE, [dense], rows, reference_out=model_out)
    assert torch.allclose(st.recall_per_head, torch.ones(H, dtype=torch.float64), atol=1e-6)
    assert st.error < 1e-6 and diff < 1e-5
    _, diff_wrong = ac.selection_stats(q, k, v, SCALE, [dense], rows, reference_out=model_out.flip(0))
    assert diff_wrong > 0.1  # the capture check notices outputs that do not match


def test_layer_checker_density_recall_and_summary():
    q, k, v = _qkv(3)
    base = dict(block_size=32, flex_block_size=32, last_q=32, min_budget=32)
    variants = [Variant("dense", None), parse_variant("vs=vertical_size=20,slash_size=40"),
                parse_variant("wide=default_pattern=a_shape,sink_tokens=32,local_window=4096")]
    checker = ac.LayerChecker(variants, rows=N, base_settings=base)
    vs, wide = checker(0, q, k, v, SCALE)
    s = variants[1].settings(**base)
    index = estimate_index(q, k, 0, [resolve_head(None, s)] * H, s, SCALE).index
    recall, err, _, density = _brute_force(q, k, v, index, torch.arange(N))
    assert vs.variant == "vs" and vs.density == pytest.approx(density)
    assert vs.recall == pytest.approx(float(recall.mean()), abs=1e-5)
    assert vs.recall_min_head == pytest.approx(float(recall.mean(-1).min()), abs=1e-5)
    assert vs.error == pytest.approx(err, rel=1e-4) and vs.head_patterns == {"vertical_slash": H}
    # a window longer than the prompt selects everything
    assert wide.density == 1.0 and wide.recall == pytest.approx(1.0, abs=1e-6) and wide.error < 1e-6
    checker(1, q, k, v, SCALE)
    summary = ac.summarize(checker.results)
    assert list(summary) == ["vs", "wide"] and summary["vs"]["layers"] == 2
    assert summary["vs"]["recall_min_layer"] == pytest.approx(vs.recall)


def test_sample_rows():
    assert torch.equal(ac.sample_rows(10, 10), torch.arange(10))
    assert torch.equal(ac.sample_rows(10, 50), torch.arange(10))
    rows = ac.sample_rows(1000, 100, seed=5)
    assert rows.shape == (100,) and torch.equal(rows, ac.sample_rows(1000, 100, seed=5))
    assert torch.equal(rows // 10, torch.arange(100))  # one row in each stratum of ten
    assert not torch.equal(rows, ac.sample_rows(1000, 100, seed=6))


def test_variants():
    assert parse_variant("dense").dense and parse_variant("flex0.9").overrides["gamma"] == 0.9
    v = parse_variant("vs-small=vertical_size=250,slash_size=500")
    assert v.settings().vertical_size == 250
    assert v.env(min_sparse_query_len=512) == {
        "VLLM_SPARSE_MIN_SPARSE_QUERY_LEN": "512", "VLLM_SPARSE_VERTICAL_SIZE": "250",
        "VLLM_SPARSE_SLASH_SIZE": "500"}
    for bad in ("nope", "x=no_such_field=1", "x=gamma=2.0"):
        with pytest.raises(ValueError):
            parse_variant(bad)
    assert set(PRESETS) >= {"dense", "vs", "flex0.9", "flex0.95"}


def test_searched_variant_finds_a_shipped_file(tmp_path):
    (tmp_path / "my-model.json").write_text("{}")
    v = searched_variant(["My-Model", "my-model"], tmp_path)
    assert v.label == "searched" and v.overrides == {"head_config": str(tmp_path / "my-model.json")}
    assert searched_variant(["other"], tmp_path) is None


@pytest.mark.slow
def test_capture_from_a_tiny_transformers_model(tmp_path):
    """Post-RoPE Q/K: recomputing attention from what the capture hands over reproduces each
    layer's own SDPA output (pre-RoPE tensors would not)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, max_position_embeddings=2048, rope_theta=10000.0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    checker = ac.LayerChecker([parse_variant("vs=vertical_size=16,slash_size=32")], rows=64,
                              base_settings={"block_size": 32, "last_q": 32})
    seen = []

    def on_layer(layer, q, k, v, scale, out):
        seen.append((layer, q.shape, k.shape, v.shape, scale, out.shape))
        checker(layer, q, k, v, scale, out)

    ac.capture_attention(str(tmp_path), ids, on_layer)
    assert seen == [(i, (400, 4, 16), (400, 2, 16), (400, 2, 16), 0.25, (400, 4, 16)) for i in range(2)]
    assert checker.capture_diff < 1e-4
    assert [r.layer for r in checker.results] == [0, 1]
    assert all(0 < r.density < 1 and 0 < r.recall <= 1 for r in checker.results)
