"""The kernel-aware search: it picks the planted pattern on synthetic heads; its batched tile
counts equal the estimator's index; every unit is tuned to the tile budget (per head or per KV
group, as the backend shares selections) and, with a cap, under the backend's density gate; its
sampled-row score equals float64 brute force; the whole command on a tiny transformers model
writes a valid file whose achieved density is the target, and resumes a killed run.

With head dim = kv_len and K = identity, Q K^T is any logit matrix we like, so each synthetic
head's attention is exactly A-shape, vertical-slash or block-sparse (plus noise).
"""

import json

import pytest
import torch

from vllm_sparse_kernels.reference.dense import causal_mask, masked_attention_f64

from vllm_sparse_tools import search as S
from vllm_sparse_tools.cli import main as main_cli
from vllm_sparse_backend.settings import SparseSettings
from vllm_sparse_tools.evaluation import attention_check as ac
from vllm_sparse_backend.head_configs import load_head_config, resolve_head
from vllm_sparse_backend.prefill.index import build_index, causal_block_mask
from vllm_sparse_kernels.reference.index import index_to_dense_mask
from vllm_sparse_backend.prefill.estimate import estimate_index
from vllm_sparse_backend.prefill.patterns.base import last_queries_probs, sum_head_groups, vertical_and_slash_sums
from vllm_sparse_backend.prefill.budgets import kv_group_share
from vllm_sparse_backend.prefill.patterns import PATTERNS
from vllm_sparse_backend.prefill.patterns.a_shape import AShape
from vllm_sparse_backend.prefill.patterns.base import SearchKnob
from vllm_sparse_kernels.kv_layout import kv_head_map
from vllm_sparse_tools.evaluation.attention_check import causal_tiles, kernel_tiles
from vllm_sparse_tools.search import search_head, search_layer

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
    if kind == "a_shape":
        hot = (j < 16) | ((i - j) >= 0) & ((i - j) < 100)
    elif kind == "vertical_slash":
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


@pytest.mark.parametrize("kind", ["a_shape", "vertical_slash", "block_sparse"])
def test_search_picks_the_planted_pattern(kind):
    gen = torch.Generator().manual_seed(11)
    q, k, v = _planted(kind, gen)
    settings = SparseSettings(last_q=64, keep_first_columns=0, keep_last_diagonals=3)
    results = search_head(q, k, v, 0, density=DENSITY, settings=settings, scale=1.0)
    assert results[0].pattern.pattern == kind, [(r.pattern.pattern, r.tiles, round(r.error, 4)) for r in results]
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
    heads = [_planted(kind, gen) for kind in ("a_shape", "block_sparse")]
    q = torch.cat([h[0] for h in heads], dim=1)
    k = torch.cat([h[1] for h in heads], dim=1)
    v = torch.cat([h[2] for h in heads], dim=1)
    best = search_layer(q, k, v, density=DENSITY, settings=SparseSettings(keep_first_columns=0), scale=1.0)
    assert [b.pattern for b in best] == ["a_shape", "block_sparse"]
    assert all(b.score is not None and 0 <= b.score < 0.5 for b in best)


def _tiny_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tiny_llama import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path / "tiny", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
    model.save_pretrained(model_dir)
    return model_dir


def _calibration_text(tmp_path):
    import json as json_module
    from pathlib import Path

    text = tmp_path / "calibration.txt"
    text.write_text(Path(json_module.__file__).with_name("decoder.py").read_text() * 12)
    return text


def test_search_patterns_cli_writes_a_valid_head_config(tmp_path, capsys, monkeypatch):
    """The whole tool on a tiny random-weight Llama run by transformers (CPU): capture Q/K/V per
    layer, search every KV group in the capture callback, write a file the backend loads, verify
    it on the calibration prompts: its achieved tile density is the target's, and its metadata
    records length, target, achieved density, model and date."""
    monkeypatch.setenv("VLLM_SPARSE_BLOCK_SIZE", "32")  # 64 query blocks: fine knob steps
    model_dir = _tiny_model(tmp_path)
    text = _calibration_text(tmp_path)
    out = tmp_path / "tiny.json"
    assert main_cli(["search-patterns", "--model", str(model_dir), "--out", str(out), "--length", "2048",
                     "--samples", "2", "--density", "0.4", "--rows", "200", "--tail-rows", "32",
                     "--device", "cpu", "--text", str(text), "--max-budget-density", "1"]) == 0
    log = capsys.readouterr().out
    assert "sample 2/2 layer  1:" in log and "verify 2/2 layer  1:" in log and "achieved" in log
    cfg = load_head_config(out)
    assert (cfg.num_layers, cfg.num_heads, cfg.model) == (2, 4, "tiny")
    assert all(h.score is not None and h.score >= 0 for layer in cfg.layers for h in layer.heads)
    assert "2 calibration prompt(s) of 2048 tokens" in cfg.produced_by
    m = cfg.settings
    assert m["density"] == m["density_target"] == 0.4 and m["length"] == 2048 and m["samples"] == 2
    assert m["block_size"] == 32
    assert m["model"] == "tiny" and m["date"] and m["selection"] == "per_kv_group" and m["kv_group_shared"]
    achieved = m["achieved"]
    assert abs(achieved["tile_density"] - 0.4) < 0.05, achieved
    assert 0 < achieved["density"] <= achieved["tile_density"] + 0.02
    assert achieved["shared_layers"] == 2 and 0 < achieved["recall"] <= 1
    # one pattern and budgets per KV group: the backend runs one selection for the group
    for layer in cfg.layers:
        for g in (0, 2):
            a, b = (h.model_copy(update={"score": None}) for h in layer.heads[g:g + 2])
            assert a == b
    assert not (tmp_path / "tiny.json.partial.json").exists()
    assert main_cli(["check-head-config", str(out)]) == 0


def test_search_resumes_from_the_partial_file(tmp_path, monkeypatch):
    """A run killed after its first layer leaves <out>.partial.json; --resume searches only the
    layers it lacks and gives the same file."""
    model_dir = _tiny_model(tmp_path)
    cap = ac.CaptureModel(str(model_dir), "cpu")
    ids = [list(range(5, 5 + 640)), list(range(700, 700 + 640))]
    settings = SparseSettings()
    kw = dict(rows=100, tail_rows=16, device="cpu", capture=cap, verify=False, log=lambda m: None)
    whole = S.search_model(str(model_dir), ids, 0.5, settings, "tiny", "t", out_path=str(tmp_path / "a.json"), **kw)
    real = S.search_layer_batched
    calls = []

    def dies_after_three(*a, **k):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(S, "search_layer_batched", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        S.search_model(str(model_dir), ids, 0.5, settings, "tiny", "t", out_path=str(tmp_path / "b.json"), **kw)
    state = json.loads((tmp_path / "b.json.partial.json").read_text())
    assert sorted(state["layers"]) == ["0:0", "0:1", "1:0"]
    calls.clear()
    monkeypatch.setattr(S, "search_layer_batched", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = S.search_model(str(model_dir), ids, 0.5, settings, "tiny", "t", out_path=str(tmp_path / "b.json"),
                           resume=True, **kw)
    assert len(calls) == 1
    assert again.layers == whole.layers == load_head_config(tmp_path / "b.json").layers


def test_search_patterns_cli_names_a_missing_model_folder(tmp_path, capsys):
    assert main_cli(["search-patterns", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "x.json")]) == 2
    assert "not a Hugging Face model folder" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The batched search: tile counts, KV-group sharing, sampled-row scoring, calibration prompts
# ---------------------------------------------------------------------------------------------



def _gqa(n, h, hkv, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, h, d, generator=g) * 2
    k = torch.randn(n, hkv, d, generator=g) * 2
    k[:4] += 3 * q.mean((0, 1))  # sink-like keys
    v = torch.randn(n, hkv, d, generator=g)
    return q, k, v


def _served_index(q, k, family, knobs, share, settings, scale):
    """What the backend's estimator builds for the layer with this family at these unit knobs."""
    s = settings.model_copy(update={"kv_group_shared": share > 1})
    heads = [resolve_head(S.candidate_pattern(family[0], knobs[hh // share], family[1]), s)
             for hh in range(q.shape[1])]
    assert kv_group_share(heads, k.shape[1], s) == share
    return estimate_index(q, k, 0, heads, s, scale).index


@pytest.mark.parametrize("n, b, share, settings", [
    (1000, 64, 1, dict(last_q=32)), (1000, 64, 3, dict(last_q=32)),
    (777, 32, 3, dict(last_q=64, keep_first_columns=0, keep_last_diagonals=1)),
])
@pytest.mark.parametrize("slash_tiles", ["ranges", "blocks"])
def test_vs_tile_counts_equal_the_estimators_index(n, b, share, settings, slash_tiles):
    """The bisection's tile counts (from ranks, no index built) are the kernel tiles of the index
    the backend's estimator builds at the same budgets, per head or per KV group."""
    h, hkv, scale = 6, 2, 0.18
    q, k, _ = _gqa(n, h, hkv)
    s = SparseSettings(block_size=b, slash_tiles=slash_tiles, **settings)
    tables = S.TileTables(n, b)
    vs = s.patterns.vertical_slash
    probs, qpos = last_queries_probs(q, k, kv_head_map(h, hkv), 0, vs.last_q, scale)
    vert, sl = (sum_head_groups(x, share) for x in vertical_and_slash_sums(probs, qpos))
    vert[:, :vs.keep_first_columns] = float("inf")
    sl[:, :max(1, vs.keep_last_diagonals)] = float("inf")
    vr, sr = S._ranks(vert), S._ranks(sl)
    units = h // share
    for knob in (1, 7, 60, 300, n):
        for ratio in S.VS_RATIOS:
            slash = max(1, round(ratio * knob))
            pred = S.vs_tiles(vr, sr, torch.full((units,), min(knob, n)), torch.full((units,), min(slash, n)),
                              tables.causal, b, slash_tiles)
            index = _served_index(q, k, ("vertical_slash", ratio), [knob] * units, share, s, scale)
            assert torch.equal(pred, ac.kernel_tiles_per_head(index)[::share]), (knob, ratio)
    for family, knobs, tiles in (("a_shape", tables.ashape_knobs, tables.ashape_tiles),
                                 ("block_sparse", tables.block_knobs, tables.block_tiles)):
        for i in range(0, len(knobs), 4):
            index = _served_index(q, k, (family, None), [int(knobs[i])] * units, share, s, scale)
            assert (ac.kernel_tiles_per_head(index) == tiles[i]).all(), (family, int(knobs[i]))


@pytest.mark.parametrize("share", [1, 4])
def test_batched_search_tunes_every_unit_to_the_budget(share):
    """Every candidate of every unit is the largest within the tile budget (one knob step more
    goes over it), and with share = the GQA group the heads of a group get one knob."""
    n, h, hkv, b = 1536, 8, 2, 64
    q, k, v = _gqa(n, h, hkv, seed=1)
    s = SparseSettings(block_size=b, last_q=64, keep_first_columns=4, keep_last_diagonals=4)
    res = S.search_layer_batched(q, k, v, 0.18, 0.3, s, torch.arange(0, n, 7), share=share)
    tables = S.TileTables(n, b)
    assert res.target == int(0.3 * tables.causal_per_head) and res.causal == tables.causal_per_head
    assert len(res.knobs[0]) == h // share and len(res.tiles[0]) == h
    for i, fam in enumerate(res.family_keys()):
        # within the budget, unless even the smallest knob is over it (8 scattered diagonals of
        # random attention cost more than 30% of the tiles at this size)
        assert all(t <= res.target or res.knobs[i][hh // share] == 1 for hh, t in enumerate(res.tiles[i])), fam
        for hh in range(h):  # heads of a unit run the same selection
            assert res.tiles[i][hh] == res.tiles[i][(hh // share) * share]
        if fam[0] == "vertical_slash":
            more = _served_index(q, k, fam, [x + 1 for x in res.knobs[i]], share, s, 0.18)
            assert (ac.kernel_tiles_per_head(more)[::share] > res.target).all(), fam
    # A-shape and block-sparse (one block per query block per knob step) within 10% of the budget
    for i, fam in enumerate(res.family_keys()):
        if fam[1] is None:
            assert min(res.tiles[i]) >= 0.9 * res.target, fam


@pytest.mark.parametrize("cap", [0.15, 0.3])
def test_budget_cap_keeps_layers_under_the_backends_density_gate(cap):
    """With max_budget_density every candidate's budgets pass the CUDA backend's check
    (budgets.budget_density <= max_density at this length), so the layer is not routed dense; the
    cap only lowers knobs (never raises tiles)."""
    from vllm_sparse_backend.prefill.budgets import budget_density

    n, h, hkv, b = 2048, 8, 2, 64
    q, k, v = _gqa(n, h, hkv, seed=3)
    s = SparseSettings(block_size=b)
    free = S.search_layer_batched(q, k, v, 0.18, 0.35, s, torch.arange(0, n, 9), share=4)
    capped = S.search_layer_batched(q, k, v, 0.18, 0.35, s, torch.arange(0, n, 9), share=4,
                                    max_budget_density=cap)
    for i, fam in enumerate(capped.family_keys()):
        heads = [resolve_head(S.candidate_pattern(fam[0], capped.knobs[i][hh // 4], fam[1]), s) for hh in range(h)]
        assert budget_density(heads, n, 0, s) <= cap + 1e-9, (fam, capped.knobs[i])
        assert all(c <= f for c, f in zip(capped.knobs[i], free.knobs[i]))
    over = [budget_density([resolve_head(S.candidate_pattern(f[0], free.knobs[i][0], f[1]), s)] * h, n, 0, s)
            for i, f in enumerate(free.family_keys())]
    assert max(over) > cap  # the cap did bind somewhere


def test_sampled_row_error_equals_float64_brute_force():
    """The search's score (relative output error per head and per KV group on sampled rows, the
    last rows included) equals float64 softmax with explicit masks over the same rows."""
    n, h, hkv, b, scale = 700, 4, 2, 32, 0.2
    q, k, v = _gqa(n, h, hkv, d=16, seed=2)
    s = SparseSettings(block_size=b, last_q=32, keep_first_columns=2, keep_last_diagonals=2)
    rows = ac.score_rows(n, 60, seed=4, tail=16)
    assert torch.equal(rows[-16:], torch.arange(n - 16, n)) and rows.numel() == 60
    for share in (1, 2):
        res = S.search_layer_batched(q, k, v, scale, 0.35, s, rows, share=share, tile=13)
        full = causal_mask(h, n, 0)
        dense = masked_attention_f64(q, k, v, full, scale)[rows]  # [R, H, D]
        for i, fam in enumerate(res.family_keys()):
            index = _served_index(q, k, fam, res.knobs[i], share, s, scale)
            sparse = masked_attention_f64(q, k, v, index_to_dense_mask(index, n, 0), scale)[rows]
            err_sq = ((sparse - dense) ** 2).sum((0, 2))
            ref_sq = (dense ** 2).sum((0, 2))
            assert torch.allclose(torch.tensor(res.err_sq[i], dtype=torch.float64), err_sq, rtol=1e-4, atol=1e-9)
            assert torch.allclose(torch.tensor(res.ref_sq, dtype=torch.float64), ref_sq, rtol=1e-5)
            unit = (err_sq.view(-1, share).sum(1) / ref_sq.view(-1, share).sum(1)).sqrt()
            assert res.unit_errors()[i] == pytest.approx(unit.tolist(), rel=1e-4)
            assert res.head_errors()[i] == pytest.approx((err_sq / ref_sq).sqrt().tolist(), rel=1e-4)


def test_aggregate_picks_per_unit_and_averages_knobs():
    fams = [["a_shape", None], ["vertical_slash", 1.0]]

    def ls(knobs, err):
        return S.LayerSearch(share=2, families=fams, knobs=knobs, tiles=[[1] * 4, [1] * 4], err_sq=err,
                             ref_sq=[1.0] * 4, target=10, causal=20)

    a = ls([[128, 128], [100, 200]], [[0.04, 0.04, 0.01, 0.01], [0.01, 0.01, 0.04, 0.04]])
    b = ls([[128, 128], [110, 210]], [[0.04, 0.04, 0.01, 0.01], [0.01, 0.01, 0.04, 0.04]])
    (layer,) = S.aggregate([[a], [b]], 4)
    assert [hp.pattern for hp in layer] == ["vertical_slash"] * 2 + ["a_shape"] * 2
    assert layer[0].vertical_size == layer[1].vertical_size == 105 and layer[0].slash_size == 105
    assert layer[2].local_window == 128 and layer[2].score == pytest.approx(0.1)


def test_the_candidate_families_are_the_registered_patterns_search_knobs():
    """The candidates, their names in the log, their head patterns and the tie order, as the
    search had them when they were listed here by hand."""
    assert S.FAMILIES == (("a_shape", None), ("vertical_slash", 8.0), ("vertical_slash", 1.0),
                          ("vertical_slash", 0.125), ("block_sparse", None))
    assert [S.family_name(f) for f in S.FAMILIES] == ["ashape", "vs8", "vs1", "vs0.125", "block"]
    assert S.SERVING_PREFERENCE == ("a_shape", "vertical_slash", "block_sparse")
    got = [S.candidate_pattern(p, knob, r).model_dump(exclude={"score"}) for p, r in S.FAMILIES for knob in (0, 5)]
    assert got == [{"pattern": "a_shape", "sink_tokens": 64, "local_window": 1},
                   {"pattern": "a_shape", "sink_tokens": 64, "local_window": 5},
                   {"pattern": "vertical_slash", "vertical_size": 1, "slash_size": 1},
                   {"pattern": "vertical_slash", "vertical_size": 5, "slash_size": 40},
                   {"pattern": "vertical_slash", "vertical_size": 1, "slash_size": 1},
                   {"pattern": "vertical_slash", "vertical_size": 5, "slash_size": 5},
                   {"pattern": "vertical_slash", "vertical_size": 1, "slash_size": 1},
                   {"pattern": "vertical_slash", "vertical_size": 5, "slash_size": 1},
                   {"pattern": "block_sparse", "topk_blocks": 1},
                   {"pattern": "block_sparse", "topk_blocks": 5}]
    for name in ("dense", "flex_prefill", "nope"):
        with pytest.raises(ValueError, match=f"no search knob for {name}"):
            S.candidate_pattern(name, 3)


class WideSinks(AShape):
    """A new searchable pattern (A-shape with four blocks of sinks) that the search has no exact
    tile count for: its declaration and the registry line are all it adds."""

    name = "wide_sinks"
    search = SearchKnob("wide", "local_window", serving_cost=3, fixed=(("sink_tokens", 256),))


@pytest.mark.parametrize("share, cap", [(1, None), (4, None), (4, 0.8)])
def test_a_new_searchable_pattern_is_tuned_by_its_estimator(monkeypatch, share, cap):
    """Registered, it becomes a candidate with no edit of the search, and every unit gets the
    largest window within the tile budget (and the budget cap), counted from the A-shape tile
    table with its 256 sinks (a window selects the key blocks its next multiple of the block
    size does)."""
    monkeypatch.setitem(PATTERNS, WideSinks.name, WideSinks())
    assert S.search_families()[-1] == ("wide_sinks", None) and S.serving_preference()[-1] == "wide_sinks"
    assert S.family_name(("wide_sinks", None)) == "wide"
    n, h, hkv, b = 1024, 8, 2, 64
    q, k, v = _gqa(n, h, hkv, seed=5)
    s = SparseSettings(block_size=b)
    res = S.search_layer_batched(q, k, v, 0.18, 0.8, s, torch.arange(0, n, 11), share=share,
                                 families=[("a_shape", None), ("wide_sinks", None)], max_budget_density=cap)
    tables = S.TileTables(n, b, sink_tokens=256)
    windows = torch.arange(1, n + 1)
    fits = tables.ashape_tiles[(windows + b - 1) // b - 1] <= res.target
    if cap is not None:  # keys per query: sinks + window, within the cap's share of the keys seen
        fits &= windows + 256 <= cap * (n + 1) / 2
    want = int(windows[fits].max())
    assert 64 < want < n and (cap is None or want % b)  # the budget (or the cap) binds inside the range
    assert res.knobs[1] == [want] * (h // share)
    assert res.knobs[0] != res.knobs[1]  # the 64-sink A-shape reaches further for the same tiles


def test_calibration_prompts():
    words = ("It is a truth universally acknowledged, that a single man in possession of a good "
             "fortune, must be in want of a wife. ") * 400

    def encode(s):
        return [ord(c) for c in s]  # one token per character

    prompts = S.calibration_prompts(encode, words, 3000, 2)
    assert [len(p) for p in prompts] == [3000, 3000] and prompts[0] != prompts[1]
    texts = ["".join(map(chr, p)) for p in prompts]
    assert all("secret passcode for the blue door is" in t for t in texts)
    assert all(t.endswith("What is the secret passcode for the blue door? It is") for t in texts)
    with pytest.raises(ValueError, match="too little text"):
        S.calibration_prompts(encode, words[:1000], 3000, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_batched_search_on_cuda_matches_cpu():
    n, h, hkv = 4096, 12, 2
    q, k, v = _gqa(n, h, hkv, d=128, seed=5)
    s = SparseSettings()
    rows = ac.score_rows(n, 256, seed=1, tail=64)
    cpu = S.search_layer_batched(q, k, v, 0.09, 0.3, s, rows, share=6)
    gpu = S.search_layer_batched(q.cuda(), k.cuda(), v.cuda(), 0.09, 0.3, s, rows, share=6)
    assert gpu.target == cpu.target
    for i in range(len(cpu.families)):
        assert gpu.knobs[i] == pytest.approx(cpu.knobs[i], rel=0.02, abs=2)
        assert gpu.err_sq[i] == pytest.approx(cpu.err_sq[i], rel=0.05)
