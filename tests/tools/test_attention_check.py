"""The attention check against brute force: recall, output error and density of a sparse index
on small synthetic Q/K/V (float64 full attention with explicit masks), and the capture from a
tiny random transformers model (our dense attention equals the model's own layer output)."""

from __future__ import annotations

import pytest
import torch
from vllm_sparse_kernels.reference.dense import causal_mask, masked_attention_f64

from vllm_sparse_backend.settings import SparseSettings
from vllm_sparse_tools.evaluation import attention_check as ac
from vllm_sparse_tools.evaluation.variants import PRESETS, Variant, parse_variant, searched_variant
from vllm_sparse_backend.head_configs import resolve_head
from vllm_sparse_backend.prefill.index import build_index, causal_block_mask, count_pairs
from vllm_sparse_kernels.reference.index import index_to_dense_mask
from vllm_sparse_backend.prefill.estimate import estimate_index
from vllm_sparse_kernels.index_format import causal_pairs

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
    """Vertical-slash (slash lines as key ranges), A-shape, block-sparse and FlexPrefill heads with
    small budgets."""
    s = SparseSettings(block_size=16, flex_block_size=16, vertical_size=8, slash_size=6, last_q=16,
                       keep_first_columns=2, keep_last_diagonals=2, sink_tokens=16, local_window=48,
                       topk_blocks=4, min_budget=16, gamma=0.7, slash_tiles="ranges")
    heads = [resolve_head(None, s.model_copy(update={"default_pattern": p}))
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
    assert index.range_count[0].any() and index.block_count[1:].any()  # ranges and blocks both
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
    assert v.settings().patterns.vertical_slash.vertical_size == 250
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


def _save_tiny_llama(path, layers: int, max_positions: int, heads: int = 4, head_dim: int = 16,
                     intermediate: int = 128) -> None:
    """A random-weight Llama with 2 KV heads saved to ``path`` (skips without transformers)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=heads * head_dim, intermediate_size=intermediate,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                                   head_dim=head_dim, max_position_embeddings=max_positions, rope_theta=10000.0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)



@pytest.mark.slow
def test_capture_from_a_tiny_transformers_model(tmp_path):
    """Post-RoPE Q/K: recomputing attention from what the capture hands over reproduces each
    layer's own SDPA output (pre-RoPE tensors would not)."""
    _save_tiny_llama(tmp_path, layers=2, max_positions=2048)
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


def test_score_rows_keep_the_last_rows():
    rows = ac.score_rows(1000, 100, seed=2, tail=30)
    assert rows.numel() == 100 and torch.equal(rows, rows.sort().values)
    assert torch.equal(rows[-30:], torch.arange(970, 1000))
    assert torch.equal(rows[:70], ac.sample_rows(970, 70, seed=2))  # stratified before the tail
    assert torch.equal(ac.score_rows(50, 100, tail=10), torch.arange(50))
    assert torch.equal(ac.score_rows(1000, 100, seed=2), ac.sample_rows(1000, 100, seed=2))


@pytest.mark.parametrize("chunk", [0, 256])
def test_row_oracle_keeps_each_rows_best_blocks(chunk):
    """The per-row block oracle against float64 brute force: each sampled row keeps the
    ceil(d x causal blocks) key blocks of most true mass (searched by sorting every block's mass
    here), and no estimated selection at that density keeps more."""
    q, k, v = _qkv(6)
    b, d = 32, 0.3
    rows = ac.score_rows(N, 60, seed=0)  # the checker's rows of layer 0
    variants = [parse_variant("bs=default_pattern=block_sparse,topk_blocks=3")]
    checker = ac.LayerChecker(variants, rows=60, base_settings=dict(block_size=b), chunk=chunk,
                              oracle_densities=[d, 1.0], oracle_block_size=b)
    est, oracle, full = checker(0, q, k, v, SCALE)
    assert (oracle.variant, full.variant) == (ac.oracle_label(d), "row-oracle@1")
    assert full.recall == pytest.approx(1.0, abs=1e-6) and full.error < 1e-6
    kvh = torch.arange(H) // (H // HKV)
    sc = torch.einsum("qhd,khd->hqk", q.double(), k.double()[:, kvh]) * SCALE
    p = torch.softmax(sc.masked_fill(~causal_mask(H, N, 0), float("-inf")), -1)  # chunks change no row's p
    recall = []
    for r in rows.tolist():
        n_keep = -(-int(d * 1e6) * (r // b + 1) // int(1e6))
        mass = torch.stack([p[:, r, j * b:(j + 1) * b].sum(-1) for j in range(-(-N // b))], -1)  # [H, NKB]
        recall.append(mass.sort(-1, descending=True).values[:, :n_keep].sum(-1))
    assert oracle.recall == pytest.approx(float(torch.stack(recall).mean()), abs=1e-5)
    assert oracle.recall > est.recall and est.density < d


@pytest.mark.parametrize("chunk", [256, 200])
def test_chunked_checker_matches_brute_force(chunk):
    """With ``chunk`` every chunk is estimated against the keys up to its end, at its own
    position (what chunked prefill runs); recall, error and density equal float64 brute force
    over the union of the chunks' masks."""
    q, k, v = _qkv(4)
    base = dict(block_size=32, flex_block_size=32, last_q=32, min_budget=32)
    variants = [parse_variant("vs=vertical_size=20,slash_size=40"),
                parse_variant("flex=default_pattern=flex_prefill,gamma=0.6")]
    rows = ac.score_rows(N, 90, seed=0, tail=20)
    checker = ac.LayerChecker(variants, rows=90, base_settings=base, chunk=chunk, tail=20)
    results = checker(0, q, k, v, SCALE)
    for var, res in zip(variants, results):
        s = var.settings(**base)
        heads = [resolve_head(None, s)] * H
        mask = torch.zeros(H, N, N, dtype=torch.bool)
        for c0 in range(0, N, chunk):
            c1 = min(N, c0 + chunk)
            index = estimate_index(q[c0:c1], k[:c1], c0, heads, s, SCALE).index
            mask[:, c0:c1, :c1] = index_to_dense_mask(index, c1 - c0, c0)
        full = causal_mask(H, N, 0)
        kvh = torch.arange(H) // (H // HKV)
        sc = torch.einsum("qhd,khd->hqk", q.double(), k.double()[:, kvh]) * SCALE
        p = torch.softmax(sc.masked_fill(~full, float("-inf")), -1)
        recall = (p * mask).sum(-1)[:, rows]
        dense = masked_attention_f64(q, k, v, full, SCALE)[rows]
        sparse = masked_attention_f64(q, k, v, mask, SCALE)[rows]
        assert res.chunks == -(-N // chunk)
        assert res.density == pytest.approx(mask.sum().item() / causal_pairs(N, 0, H))
        assert res.recall == pytest.approx(float(recall.mean()), abs=1e-5)
        # the question's rows (the last 20) scored alone: their own mean and worst head
        tail_recall = (p * mask).sum(-1)[:, N - 20:].double().mean(-1)
        assert res.tail_recall == pytest.approx(float(tail_recall.mean()), abs=1e-5)
        assert res.tail_recall_min_head == pytest.approx(float(tail_recall.min()), abs=1e-5)
        assert res.error == pytest.approx(float((sparse - dense).norm() / dense.norm()), rel=1e-4, abs=1e-6)
        assert 0 < res.tile_density <= 1 and res.density < 1


def test_gating_routes_chunks_dense_like_the_backend():
    q, k, v = _qkv(5)
    base = dict(block_size=32, flex_block_size=32, last_q=32, min_budget=32)
    short = ac.LayerChecker([parse_variant("vs=vertical_size=20,slash_size=40")], rows=N, chunk=300, gating=True,
                            base_settings={**base, "min_sparse_query_len": 301})
    (r,) = short(0, q, k, v, SCALE)
    assert r.density == 1.0 and r.error < 1e-6 and r.dense_chunks == {ac.GATING_SHORT: 2}
    budgets = ac.LayerChecker([parse_variant("vs=vertical_size=200,slash_size=400")], rows=N, chunk=300,
                              gating=True, base_settings={**base, "min_sparse_query_len": 100, "max_density": 0.3})
    (r,) = budgets(0, q, k, v, SCALE)
    assert r.density == 1.0 and r.dense_chunks.get(ac.GATING_BUDGETS) == 2
    est = ac.LayerChecker([parse_variant("vs=vertical_size=8,slash_size=8")], rows=N, chunk=300, gating=True,
                          base_settings={**base, "min_sparse_query_len": 100, "max_density": 0.05})
    (r,) = est(0, q, k, v, SCALE)
    assert r.dense_chunks.get(ac.GATING_ESTIMATED, 0) >= 1
    off = ac.LayerChecker([parse_variant("vs=vertical_size=8,slash_size=8")], rows=N, chunk=300,
                          base_settings={**base, "min_sparse_query_len": 100, "max_density": 0.05})
    (r,) = off(0, q, k, v, SCALE)
    assert r.dense_chunks == {} and r.density < 0.5


def test_checker_reports_the_backends_group_sharing(tmp_path):
    """The default vertical-slash shares one selection per KV group (summed scores) as the
    backend does; FlexPrefill and kv_group_shared=false do not."""
    q, k, v = _qkv(6)
    base = dict(block_size=32, flex_block_size=32, last_q=32, min_budget=32)
    variants = [parse_variant("vs=vertical_size=20,slash_size=40"),
                parse_variant("vs-head=vertical_size=20,slash_size=40,kv_group_shared=false"),
                parse_variant("flex0.9")]
    shared, per_head, flex = ac.LayerChecker(variants, rows=64, base_settings=base)(0, q, k, v, SCALE)
    assert (shared.kv_share, per_head.kv_share, flex.kv_share) == (H // HKV, 1, 1)
    s = variants[0].settings(**base)
    index = estimate_index(q, k, 0, [resolve_head(None, s)] * H, s, SCALE).index
    assert torch.equal(index.block_index[0], index.block_index[1])  # heads 0 and 1: one group
    assert shared.density == pytest.approx(count_pairs(index, N, 0) / causal_pairs(N, 0, H))


def _tiny_qwen_folder(path, **extra):
    """A Qwen2 config.json in the form of the cached folders (transformers 5 spelling plus the
    4.x keys patch_hf_config adds), no weights."""
    import json

    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 32768, "vocab_size": 300,
           "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "rope_scaling": None,
           "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "torch_dtype": "float32", **extra}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_yarn_option_sets_the_rope_scaling(tmp_path):
    """--yarn 4: rope_type yarn, factor 4, original_max_position_embeddings 32768 (the trained
    length), theta kept; the rotary embedding then uses YaRN frequencies and attention factor
    0.1 ln 4 + 1; without it the config is the file's."""
    pytest.importorskip("transformers")
    import math

    folder = _tiny_qwen_folder(tmp_path / "qwen")
    plain = ac.model_config(str(folder))
    yarn = ac.model_config(str(folder), yarn=4)
    rope = ac.rope_description(yarn)
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0
    assert rope["original_max_position_embeddings"] == 32768 and rope["rope_theta"] == 1e6
    assert yarn.max_position_embeddings == 131072 and plain.max_position_embeddings == 32768
    assert ac.rope_description(plain)["rope_type"] == "default"
    assert ac.model_config(str(folder), yarn=2, yarn_original=16384).rope_parameters[
        "original_max_position_embeddings"] == 16384
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    r_plain, r_yarn = Qwen2RotaryEmbedding(plain), Qwen2RotaryEmbedding(yarn)
    assert r_yarn.attention_scaling == pytest.approx(0.1 * math.log(4) + 1)
    assert r_plain.attention_scaling == 1.0
    assert torch.equal(r_yarn.inv_freq[:2], r_plain.inv_freq[:2])  # high frequencies extrapolated
    assert torch.allclose(r_yarn.inv_freq[-1], r_plain.inv_freq[-1] / 4)  # low ones interpolated
    with pytest.raises(ValueError):
        ac.model_config(str(folder), yarn=0.5)


def test_capture_with_yarn_runs_the_scaled_model(tmp_path):
    """CaptureModel loads the model with the YaRN config: the captured Q/K differ from the plain
    model's (rotary scaling) while the layer check still holds."""
    _save_tiny_llama(tmp_path, layers=1, max_positions=256)
    ids = [i % 290 + 3 for i in range(300)]
    got = {}
    for yarn in (None, 4.0):
        cap = ac.CaptureModel(str(tmp_path), "cpu", yarn=yarn)
        assert cap.device == "cpu" and cap.dtype == torch.float32
        checker = ac.LayerChecker([parse_variant("vs=vertical_size=16,slash_size=32")], rows=64,
                                  base_settings={"block_size": 32, "last_q": 32})

        def on_layer(layer, q, k, v, scale, out, yarn=yarn, checker=checker):
            got[yarn] = q.clone()
            checker(layer, q, k, v, scale, out)

        cap(ids, on_layer)
        assert checker.capture_diff < 1e-4
    assert not torch.allclose(got[None], got[4.0])


def test_fused_sdpa_path_gives_the_models_attention(tmp_path):
    """The CUDA capture path (K/V repeated to the query heads, fused SDPA kernels only) run on
    the CPU: the model's layer outputs equal the recomputed dense attention, as with
    transformers' own SDPA function, and the captured Q/K/V are the same."""
    _save_tiny_llama(tmp_path, layers=2, max_positions=2048, heads=6)
    ids = [i * 7 % 290 + 3 for i in range(333)]
    outs = {}
    for fused in (False, True):
        cap = ac.CaptureModel(str(tmp_path), "cpu")
        cap.fused_sdpa = fused
        checker = ac.LayerChecker([parse_variant("vs=vertical_size=16,slash_size=32")], rows=333,
                                  base_settings={"block_size": 32, "last_q": 32})

        def on_layer(layer, q, k, v, scale, out, fused=fused, checker=checker):
            outs[fused, layer] = (q.clone(), k.clone(), out.clone())
            checker(layer, q, k, v, scale, out)

        cap(ids, on_layer)
        assert checker.capture_diff < 1e-4
    for layer in range(2):
        for a, b in zip(outs[False, layer], outs[True, layer]):
            assert torch.allclose(a, b, atol=1e-5)
    for bad in ("gpu", "cuda:x") + (() if torch.cuda.is_available() else ("cuda",)):
        with pytest.raises(ValueError):
            ac.resolve_device(bad)
    assert ac.resolve_device("cpu") == "cpu"
    assert ac.resolve_dtype("auto", "cuda") == torch.bfloat16 and ac.resolve_dtype(None, "cpu") == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_checker_and_capture_on_cuda(tmp_path):
    """The same measurements on the GPU (tensors stay there) as on the CPU, chunked and gated;
    the capture runs bf16 with the fused SDPA path."""
    q, k, v = _qkv(7)
    base = dict(block_size=32, flex_block_size=32, last_q=32, min_budget=32, min_sparse_query_len=100)
    variants = [parse_variant("vs=vertical_size=20,slash_size=40"), parse_variant("flex0.9")]
    cpu = ac.LayerChecker(variants, rows=128, base_settings=base, chunk=256, gating=True, tail=16)(0, q, k, v, SCALE)
    gpu = ac.LayerChecker(variants, rows=128, base_settings=base, chunk=256, gating=True, tail=16)(
        0, q.cuda(), k.cuda(), v.cuda(), SCALE)
    for a, b in zip(cpu, gpu):
        assert b.density == pytest.approx(a.density, rel=0.02) and b.recall == pytest.approx(a.recall, abs=0.01)
    _save_tiny_llama(tmp_path, layers=2, max_positions=8192, head_dim=64, intermediate=256)
    cap = ac.CaptureModel(str(tmp_path), "cuda", yarn=2)
    assert cap.dtype == torch.bfloat16
    checker = ac.LayerChecker(variants, rows=256, base_settings=base, chunk=2048)
    seen = []

    def on_layer(layer, q, k, v, scale, out):
        assert q.is_cuda and q.dtype == torch.bfloat16
        seen.append(layer)
        checker(layer, q, k, v, scale, out)

    cap([i % 290 + 3 for i in range(6000)], on_layer)
    assert seen == [0, 1] and checker.capture_diff < 0.05


def test_capture_model_is_the_stock_model_and_gets_no_mask(tmp_path, monkeypatch):
    """On a tiny Qwen2 (the architecture the GPU runs use) the capture's attention gets no mask
    (so never an n x n one; the fused path is taken for every layer) and its layers' outputs are
    those of the stock transformers SDPA model."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(vocab_size=300, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    ids = [i * 7 % 290 + 3 for i in range(200)]

    def attn_outputs(model, run):
        outs = []
        hooks = [layer.self_attn.register_forward_hook(lambda mod, a, out: outs.append(out[0].detach()))
                 for layer in model.model.layers]
        run()
        for h in hooks:
            h.remove()
        return outs

    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa",
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        ref = attn_outputs(stock, lambda: stock.model(torch.tensor([ids])))
    calls = []
    real = ac._cuda_causal_sdpa
    monkeypatch.setattr(ac, "_cuda_causal_sdpa", lambda *a: calls.append(1) or real(*a))
    cap = ac.CaptureModel(str(tmp_path), "cpu")
    cap.fused_sdpa = True
    got = attn_outputs(cap.model, lambda: cap(ids, lambda *a: None))
    assert len(calls) == 2
    for a, b in zip(ref, got):
        assert torch.allclose(a, b, atol=1e-5)


def test_sample_runs_are_whole_aligned_runs():
    rows = ac.sample_runs(1000, 64, 16, seed=3)
    assert rows.numel() == 64 and torch.equal(rows, rows.sort().values)
    starts = rows.view(4, 16)[:, 0]
    assert (starts % 16 == 0).all()
    assert torch.equal(rows.view(4, 16) - starts[:, None], torch.arange(16).expand(4, 16))


def test_group_oracle_shares_one_list_per_kv_head_and_run():
    """The grouped oracle against float64 brute force: each (KV head, run of g positions) keeps the
    ceil(d x causal blocks of the run's last row) key blocks of most mass summed over the run's rows
    and the KV head's query heads; one position per group and one query head per KV head is the
    per-row oracle; a group cannot keep more than the per-row oracle."""
    q, k, v = _qkv(7)
    b, d, g = 32, 0.3, 8
    checker = ac.LayerChecker([parse_variant("bs=default_pattern=block_sparse,topk_blocks=3")], rows=64,
                              base_settings=dict(block_size=b), oracle_densities=[d], oracle_block_size=b,
                              oracle_groups=[1, g], tile=32)
    _, row_oracle, per_position, grouped = checker(0, q, k, v, SCALE)
    assert (per_position.variant, grouped.variant) == (ac.group_oracle_label(d, 1), ac.group_oracle_label(d, g))
    rows = ac.sample_runs(N, 64, g, seed=0)
    kvh = torch.arange(H) // (H // HKV)
    sc = torch.einsum("qhd,khd->hqk", q.double(), k.double()[:, kvh]) * SCALE
    p = torch.softmax(sc.masked_fill(~causal_mask(H, N, 0), float("-inf")), -1)
    nkb = -(-N // b)
    mass = torch.stack([p[:, :, j * b:(j + 1) * b].sum(-1) for j in range(nkb)], -1)  # [H, N, NKB]
    recall = []
    for run in rows.view(-1, g).tolist():
        n_keep = -(-int(d * 1e6) * (run[-1] // b + 1) // int(1e6))
        for j in range(HKV):
            heads = (kvh == j).nonzero().flatten()
            shared = mass[heads][:, run].sum((0, 1))  # [NKB]
            keep = shared.argsort(descending=True)[:n_keep]
            recall.append(mass[heads][:, run][..., keep].sum(-1).flatten())
    assert grouped.recall == pytest.approx(float(torch.cat(recall).mean()), abs=1e-5)
    assert row_oracle.recall >= per_position.recall - 1e-9 >= grouped.recall - 1e-9
    with pytest.raises(ValueError, match="must divide"):
        ac.LayerChecker([], oracle_densities=[d], oracle_groups=[3, 8], tile=32)
