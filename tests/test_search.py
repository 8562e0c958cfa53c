"""The kernel-aware search picks the planted pattern on synthetic heads.

With head dim = kv_len and K = identity, Q K^T is any logit matrix we like, so each synthetic
head's attention is exactly A-shape, vertical-slash or block-sparse (plus noise).
"""

import pytest
import torch

from vllm_sparse_backend.config import PatternName, SparseSettings
from vllm_sparse_backend.index import build_index, causal_block_mask
from vllm_sparse_backend.search import causal_tiles, kernel_tiles, search_head, search_layer

N, B = 1024, 64
DENSITY = 0.6  # of the causal key tiles: enough for every planted pattern, far from dense


def _head(logits, gen):
    """q [N, 1, N], k = identity, v random, scale 1: softmax rows are softmax(logits)."""
    q = (logits + 0.1 * torch.randn(N, N, generator=gen))[:, None, :]
    k = torch.eye(N)[:, None, :]
    v = torch.randn(N, 1, 16, generator=gen)
    return q, k, v


def _planted(kind, gen):
    i = torch.arange(N)[:, None]
    j = torch.arange(N)[None, :]
    if kind is PatternName.A_SHAPE:
        hot = (j < 16) | ((i - j) >= 0) & ((i - j) < 100)
    elif kind is PatternName.VERTICAL_SLASH:
        cols = torch.randperm(N, generator=gen)[:12]
        diags = torch.tensor([0, 1, 2, 333])
        hot = torch.isin(j, cols) | torch.isin(i - j, diags)
    else:  # block-sparse: two random past key blocks per query block, plus the diagonal block
        hot = torch.zeros(N, N, dtype=torch.bool)
        for qb in range(N // B):
            picks = torch.randperm(qb + 1, generator=gen)[:2].tolist() + [qb]
            for kb in picks:
                hot[qb * B:(qb + 1) * B, kb * B:(kb + 1) * B] = True
    return _head(torch.where(hot, 8.0, 0.0), gen)


@pytest.mark.parametrize("kind", [PatternName.A_SHAPE, PatternName.VERTICAL_SLASH, PatternName.BLOCK_SPARSE])
def test_search_picks_the_planted_pattern(kind):
    gen = torch.Generator().manual_seed(11)
    q, k, v = _planted(kind, gen)
    settings = SparseSettings(last_q=64, keep_first_columns=0, keep_last_diagonals=3)
    results = search_head(q, k, v, 0, density=DENSITY, settings=settings, scale=1.0)
    assert results[0].pattern.pattern is kind, [(r.pattern.pattern.value, r.tiles, round(r.error, 4)) for r in results]
    target = int(DENSITY * causal_tiles(N, 0, B))
    assert all(r.tiles <= target for r in results), "candidates were tuned to the same kernel cost"


def test_kernel_tiles_counts_blocks_and_column_tiles():
    full = build_index(causal_block_mask(N, 0, B)[None].clone(), B, N, 0)
    assert kernel_tiles(full) == causal_tiles(N, 0, B) == 16 * 17 // 2
    cols = torch.arange(100)[None].expand(1, -1) * 5  # 100 columns
    only_diag = torch.eye(N // B, dtype=torch.bool)[None]
    ix = build_index(only_diag, B, N, 0, cols, torch.ones(1, 100, dtype=torch.bool))
    per_block = [(ix.column_count[0, qb].item() + 63) // 64 for qb in range(N // B)]
    assert kernel_tiles(ix) == N // B + sum(per_block)


def test_search_layer_scores_every_head():
    gen = torch.Generator().manual_seed(3)
    heads = [_planted(kind, gen) for kind in (PatternName.A_SHAPE, PatternName.BLOCK_SPARSE)]
    q = torch.cat([h[0] for h in heads], dim=1)
    k = torch.cat([h[1] for h in heads], dim=1)
    v = torch.cat([h[2] for h in heads], dim=1)
    best = search_layer(q, k, v, density=DENSITY, settings=SparseSettings(keep_first_columns=0), scale=1.0)
    assert [b.pattern for b in best] == [PatternName.A_SHAPE, PatternName.BLOCK_SPARSE]
    assert all(b.score is not None and 0 <= b.score < 0.5 for b in best)


def test_search_patterns_cli_writes_a_valid_head_config(tmp_path):
    """The whole tool on a tiny random-weight Llama run by transformers: capture Q/K/V per layer,
    search every head, write a file the backend loads."""
    transformers = pytest.importorskip("transformers")
    import json as json_module
    from pathlib import Path

    from tiny_llama import make_tiny_llama
    from vllm_sparse_backend.cli import main
    from vllm_sparse_backend.head_configs import load_head_config

    model_dir = make_tiny_llama(tmp_path / "tiny", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
    model.save_pretrained(model_dir)
    text = tmp_path / "calibration.txt"
    text.write_text(Path(json_module.__file__).with_name("decoder.py").read_text() * 3)
    out = tmp_path / "tiny.json"
    assert main(["search-patterns", "--model", str(model_dir), "--out", str(out), "--tokens", "700",
                 "--samples", "2", "--density", "0.5", "--text", str(text)]) == 0
    cfg = load_head_config(out)
    assert (cfg.num_layers, cfg.num_heads, cfg.model) == (2, 4, "tiny")
    assert all(h.score is not None and h.score >= 0 for layer in cfg.layers for h in layer.heads)
    assert "2 calibration prompt(s)" in cfg.produced_by and cfg.settings["density"] == 0.5


def test_search_patterns_cli_names_a_missing_model_folder(tmp_path, capsys):
    from vllm_sparse_backend.cli import main

    assert main(["search-patterns", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "x.json")]) == 2
    assert "not a Hugging Face model folder" in capsys.readouterr().err
