"""`vllm-sparse layer-budgets`: per-layer rungs from an attention_recall run.

The choice is checked against brute force over every assignment of rungs to layers (the best
summed loss within the density target), and the written file against the head-config loader
and the model-fit check the server runs."""

import itertools
import json

import pytest

from vllm_sparse_backend.config import ConfigError
from vllm_sparse_backend.head_configs import check_fits_model, load_head_config, read_model_shape
from vllm_sparse_tools import layer_budgets as lb

VARIANTS = {"small": {"vertical_size": "100", "slash_size": "400"},
            "mid": {"vertical_size": "300", "slash_size": "1200"},
            "vs": {"default_pattern": "vertical_slash"},
            "dense": {"default_pattern": "dense"},
            "band": {"slash_band": "64"}}  # not a rung: changes more than the budget


def recall_run(table: dict[int, dict[str, tuple[float, float]]], length: int = 65536) -> dict:
    rows = [{"layer": layer, "variant": lab, "density": d, "error": e, "recall": 1 - e / 2}
            for layer, opts in table.items() for lab, (d, e) in opts.items()]
    return {"meta": {"variants": VARIANTS, "model": "m"}, "layers": {str(length): rows}}


TABLE = {0: {"small": (0.10, 0.30), "mid": (0.25, 0.10), "vs": (0.60, 0.02), "dense": (1.0, 0.0)},
         1: {"small": (0.12, 0.05), "mid": (0.30, 0.04), "vs": (0.70, 0.01), "dense": (1.0, 0.0)},
         2: {"small": (0.08, 0.40), "mid": (0.20, 0.35), "vs": (0.50, 0.05), "dense": (1.0, 0.0)},
         3: {"small": (0.15, 0.20), "mid": (0.35, 0.02), "vs": (0.80, 0.01), "dense": (1.0, 0.0)}}


def brute_force(table, density):
    best = None
    labels = list(next(iter(table.values())))
    for combo in itertools.product(labels, repeat=len(table)):
        dens = sum(table[i][lab][0] for i, lab in enumerate(combo)) / len(table)
        loss = sum(table[i][lab][1] for i, lab in enumerate(combo))
        if dens <= density + 1e-12 and (best is None or loss < best[0] - 1e-12):
            best = (loss, combo)
    return best


def test_ladder_keeps_budget_only_variants_and_fills_defaults():
    rungs = {r.label: r.pattern for r in lb.ladder_from_variants(VARIANTS)}
    assert set(rungs) == {"small", "mid", "vs", "dense"}
    assert (rungs["small"].vertical_size, rungs["small"].slash_size) == (100, 400)
    assert (rungs["vs"].vertical_size, rungs["vs"].slash_size) == (1000, 6096)  # library defaults
    assert rungs["dense"].pattern == "dense"
    with pytest.raises(ConfigError, match="band"):
        lb.ladder_from_variants(VARIANTS, ["small", "band"])


@pytest.mark.parametrize("density", [0.12, 0.2, 0.3, 0.45, 0.7])
def test_choice_is_on_the_loss_density_frontier(density):
    rungs = lb.ladder_from_variants(VARIANTS, ["small", "mid", "vs", "dense"])
    picks = lb.choose(TABLE, rungs, density)
    mean = sum(c.density for c in picks) / len(picks)
    loss = sum(c.loss for c in picks)
    assert mean <= density + 1e-9
    best_loss, _ = brute_force(TABLE, density)
    # Lagrangian choices are optimal at their own density; between frontier points they may
    # leave some budget unspent, never more than one rung step of loss behind the optimum.
    assert loss >= best_loss - 1e-12
    assert loss <= best_loss + 0.25
    tighter = sum(c.loss for c in lb.choose(TABLE, rungs, density * 0.8))
    assert tighter >= loss - 1e-12  # less density never buys a smaller loss


def test_unreachable_target_returns_the_sparsest_rungs():
    rungs = lb.ladder_from_variants(VARIANTS, ["small", "mid"])
    picks = lb.choose(TABLE, rungs, 0.01)
    assert [c.rung.label for c in picks] == ["small"] * 4


def test_written_file_loads_and_fits_the_model(tmp_path):
    run_path = tmp_path / "recall.json"
    run_path.write_text(json.dumps(recall_run(TABLE)))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 2}))
    out = tmp_path / "budgets.json"
    picks = lb.run(str(run_path), str(model), 0.3, str(out))
    cfg = load_head_config(out)
    check_fits_model(cfg, read_model_shape(model), str(out))  # what the worker checks at start-up
    assert cfg.num_layers == 4 and cfg.num_heads == 6 and cfg.num_kv_heads == 2
    for c, layer in zip(picks, cfg.layers):
        assert all(h == c.rung.pattern for h in layer.heads)
    assert cfg.settings["selection"] == "per_kv_group"
    assert abs(cfg.settings["density_measured_mean"] - sum(c.density for c in picks) / 4) < 1e-3


def test_bad_inputs_name_what_is_wrong(tmp_path):
    run = recall_run(TABLE)
    with pytest.raises(ConfigError, match="lengths"):
        lb.build_head_config(run, density=0.3, num_heads=6, num_kv_heads=2, model="m", lengths=[123])
    with pytest.raises(ConfigError, match="not in the recall run"):
        lb.build_head_config(run, density=0.3, num_heads=6, num_kv_heads=2, model="m", labels=["nope"])
    with pytest.raises(ConfigError, match="density"):
        lb.build_head_config(run, density=0.0, num_heads=6, num_kv_heads=2, model="m")
    run["layers"]["65536"] = [r for r in run["layers"]["65536"] if not (r["layer"] == 2 and r["variant"] == "mid")]
    with pytest.raises(ConfigError, match="layer 2"):
        lb.build_head_config(run, density=0.3, num_heads=6, num_kv_heads=2, model="m")
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="not an attention_recall JSON"):
        lb.run(str(bad), str(tmp_path), 0.3, str(tmp_path / "o.json"))


def test_a_run_of_another_models_layer_count_is_refused(tmp_path):
    run_path = tmp_path / "recall.json"
    run_path.write_text(json.dumps(recall_run(TABLE)))  # 4 layers measured
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 5, "num_attention_heads": 6, "num_key_value_heads": 2}))
    with pytest.raises(ConfigError, match="num_layers"):
        lb.run(str(run_path), str(model), 0.3, str(tmp_path / "o.json"))
    assert not (tmp_path / "o.json").exists()
