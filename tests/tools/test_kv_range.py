"""benchmarks/kv_range.py: per-layer ranges of q / k / v against a recomputation from the model's
hidden states, and the e4m3 spacing against torch's own float8_e4m3fn rounding."""

from __future__ import annotations


import pytest
import torch


def _kv_range():
    from benchmarks import kv_range

    return kv_range


def test_e4m3_step_is_the_spacing_of_float8_e4m3fn():
    kv = _kv_range()
    for x in (0.02, 0.3, 1.0, 3.7, 17.5, 45.0, 113.8, 300.0, 359.0):
        step = kv.e4m3_step(x)
        lo = torch.tensor(x).to(torch.float8_e4m3fn).float().item()
        # the representable neighbours around x are one step apart
        nxt = torch.tensor(lo + step * 0.75).to(torch.float8_e4m3fn).float().item()
        assert nxt - lo == pytest.approx(step), x
        assert abs(lo - x) <= step / 2 + 1e-12, x


def test_ranges_match_the_projections_of_each_layer():
    transformers = pytest.importorskip("transformers")
    kv = _kv_range()
    # Qwen2 has q/k/v biases (where its outliers come from); a large k bias in layer 0
    cfg = transformers.Qwen2Config(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.bias[3] = 300.0
    ids = torch.randint(0, 200, (1, 40))
    rows = kv.kv_ranges(model, ids)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    assert [r["layer"] for r in rows] == [0, 1, 2]
    for i, layer in enumerate(model.model.layers):
        x = layer.input_layernorm(hidden[i])
        q, k, v = (getattr(layer.self_attn, n)(x) for n in ("q_proj", "k_proj", "v_proj"))
        assert rows[i]["q"] == pytest.approx(q.abs().max().item(), rel=1e-6)
        assert rows[i]["k"] == pytest.approx(k.abs().max().item(), rel=1e-6)
        assert rows[i]["v"] == pytest.approx(v.abs().max().item(), rel=1e-6)
        kh = k.view(1, 40, 2, 16)  # head dim 64 / 4 heads
        pair = torch.sqrt(kh[..., :8] ** 2 + kh[..., 8:] ** 2).max().item()
        assert rows[i]["k_pair"] == pytest.approx(pair, rel=1e-6)
        assert rows[i]["k_pair"] >= rows[i]["k"] - 1e-6
    assert rows[0]["k"] > 250 and rows[1]["k"] < 50  # the planted bias shows in its layer only
