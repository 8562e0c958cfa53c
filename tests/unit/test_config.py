"""Settings and head-config files: valid input loads, malformed input names file/layer/head/field."""

import json

import pytest

from vllm_sparse_backend.config import ConfigError, GatingSettings
from vllm_sparse_backend.settings import SETTINGS, SparseSettings, load_settings
from vllm_sparse_backend.head_configs import (HeadConfigFile, HeadPattern, import_minference, layer_heads,
                                              load_head_config, parse_head_config, resolve_head, save_head_config)
from vllm_sparse_backend.startup import load_checked_settings


def test_defaults_follow_the_papers():
    s = load_settings({})
    vs, flex = s.patterns.vertical_slash, s.patterns.flex_prefill
    assert (vs.vertical_size, vs.slash_size, vs.last_q, s.block_size, s.patterns.block_sparse.topk_blocks) == \
        (1000, 6096, 64, 64, 100)  # MInference; 1000 diagonals lost answers at 128K (issue 53)
    assert (flex.gamma, flex.tau, flex.min_budget) == (0.95, 0.1, 1024)
    assert s.default_pattern == "vertical_slash" and s.gating.enabled
    assert s.decode.mode == "dense"  # top-k decode is opt-in (issue 8)


def test_env_overrides_file(tmp_path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"vertical_size": 10, "default_pattern": "flex_prefill", "gamma": 0.9}))
    s = load_settings({"VLLM_SPARSE_CONFIG": str(f), "VLLM_SPARSE_GAMMA": "0.8", "VLLM_SPARSE_ENABLED": "false",
                       "VLLM_SPARSE_CACHE": "/tmp/ignored", "VLLM_SPARSE_MAX_BUDGET": "none"})
    assert (s.patterns.vertical_slash.vertical_size, s.default_pattern, s.patterns.flex_prefill.gamma,
            s.gating.enabled, s.patterns.flex_prefill.max_budget) == (10, "flex_prefill", 0.8, False, None)


@pytest.mark.parametrize("env,needle", [
    ({"VLLM_SPARSE_VERTICAL_SIZE": "many"}, "VLLM_SPARSE_VERTICAL_SIZE"),
    ({"VLLM_SPARSE_GAMMA": "1.5"}, "VLLM_SPARSE_GAMMA"),
    ({"VLLM_SPARSE_DEFAULT_PATTERN": "triangle"}, "VLLM_SPARSE_DEFAULT_PATTERN"),
    ({"VLLM_SPARSE_VERTICAL": "3"}, "unknown setting"),
    ({"VLLM_SPARSE_BLOCK_SIZE": "48"}, "block_size=48"),
    ({"VLLM_SPARSE_MIN_BUDGET": "2000", "VLLM_SPARSE_MAX_BUDGET": "1000"}, "max_budget"),
    ({"VLLM_SPARSE_DECODE_MODE": "ltri"}, "VLLM_SPARSE_DECODE_MODE"),
    ({"VLLM_SPARSE_BLOCK_SCORING": "maxpool"}, "VLLM_SPARSE_BLOCK_SCORING"),
    ({"VLLM_SPARSE_ANTIDIAGONAL_STRIDE": "12"}, "antidiagonal_stride=12"),
    ({"VLLM_SPARSE_BLOCK_SIZE": "32", "VLLM_SPARSE_ANTIDIAGONAL_STRIDE": "64"}, "antidiagonal_stride=64"),
    ({"VLLM_SPARSE_BLOCK_MASS": "0.9"}, "block_mass applies to block_scoring=antidiagonal"),
    ({"VLLM_SPARSE_DECODE_SPAN_IOU": "2"}, "VLLM_SPARSE_DECODE_SPAN_IOU"),
    ({"VLLM_SPARSE_DECODE_SPAN_MIN_INDEX": "30"}, "decode_span_min_index=30"),
    ({"VLLM_SPARSE_DECODE_SPAN_PERSIST": "votes"}, "VLLM_SPARSE_DECODE_SPAN_PERSIST"),
    ({"VLLM_SPARSE_DECODE_PERSIST_NEXT": "1", "VLLM_SPARSE_DECODE_SPAN_PERSIST": "index"},
     "decode_persist_next runs of persistent pages need decode_span_persist=attention"),
    ({"VLLM_SPARSE_DECODE_SINK_PAGES": "0", "VLLM_SPARSE_DECODE_RECENT_PAGES": "0",
      "VLLM_SPARSE_DECODE_BUDGET_PAGES": "0"}, "decode_budget_pages"),
    ({"VLLM_SPARSE_SKIP_TILE_BELOW": "1"}, "VLLM_SPARSE_SKIP_TILE_BELOW"),
    ({"VLLM_SPARSE_SKIP_TILE_BELOW": "-0.001"}, "VLLM_SPARSE_SKIP_TILE_BELOW"),
    ({"VLLM_SPARSE_EXACT_PROMPT_END": "-1"}, "VLLM_SPARSE_EXACT_PROMPT_END='-1': Input should be greater than or equal"),
])
def test_bad_env_is_named(env, needle):
    with pytest.raises(ConfigError, match=needle):
        load_checked_settings(env)  # what start-up loads: the registries check the names


def test_bad_file_is_named(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"slash_size": -3}))
    with pytest.raises(ConfigError, match=r"bad\.json: field 'patterns\.vertical_slash\.slash_size'"):
        load_settings({"VLLM_SPARSE_CONFIG": str(f)})
    f.write_text("{not json")
    with pytest.raises(ConfigError, match=r"bad\.json.*invalid JSON"):
        load_settings({"VLLM_SPARSE_CONFIG": str(f)})
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings({"VLLM_SPARSE_CONFIG": str(tmp_path / "missing.json")})



def test_a_grouped_setting_is_reached_by_its_variable_its_flat_key_and_its_nested_key(tmp_path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"stats_file": "/tmp/flat.json", "observability": {"metrics_port": 9400}}))
    s = load_settings({"VLLM_SPARSE_CONFIG": str(f), "VLLM_SPARSE_TIMING_SAMPLE_EVERY": "3"})
    assert (s.observability.stats_file, s.observability.metrics_port, s.observability.timing_sample_every) == \
        ("/tmp/flat.json", 9400, 3)
    assert s.observability.stats_write_interval_s == 1.0  # the group's other fields keep their defaults
    # a variable wins over the file, flat or nested there
    s = load_settings({"VLLM_SPARSE_CONFIG": str(f), "VLLM_SPARSE_METRICS_PORT": "9500",
                       "VLLM_SPARSE_STATS_FILE": "none"})
    assert (s.observability.metrics_port, s.observability.stats_file) == (9500, None)
    assert SparseSettings(metrics_host="0.0.0.0") == SparseSettings(observability={"metrics_host": "0.0.0.0"})


def test_a_bad_grouped_setting_names_its_place(tmp_path):
    f = tmp_path / "bad.json"
    for data in ({"observability": {"metrics_port": 0}}, {"metrics_port": 0}):
        f.write_text(json.dumps(data))
        with pytest.raises(ConfigError) as err:
            load_settings({"VLLM_SPARSE_CONFIG": str(f)})
        assert str(err.value).startswith(f"{f}: field 'observability.metrics_port': Input should be greater than")
    f.write_text(json.dumps({"observability": {"metric_port": 9400}}))
    with pytest.raises(ConfigError, match=r"field 'observability\.metric_port': Extra inputs are not permitted"):
        load_settings({"VLLM_SPARSE_CONFIG": str(f)})
    f.write_text(json.dumps({"stats_file": "a.json", "observability": {"stats_file": "b.json"}}))
    with pytest.raises(ConfigError, match="'observability.stats_file' is given twice"):
        load_settings({"VLLM_SPARSE_CONFIG": str(f)})
    with pytest.raises(ConfigError) as err:
        load_settings({"VLLM_SPARSE_STATS_WRITE_INTERVAL_S": "-1"})
    assert str(err.value) == ("environment variable VLLM_SPARSE_STATS_WRITE_INTERVAL_S='-1': "
                              "Input should be greater than or equal to 0")


def test_gating_is_reached_by_its_variables_and_a_copy_by_flat_name_changes_the_nested_field(tmp_path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"gating": {"min_sparse_query_len": 512}, "cost_model": False}))
    s = load_settings({"VLLM_SPARSE_CONFIG": str(f), "VLLM_SPARSE_MAX_DENSITY": "1"})
    assert (s.gating.min_sparse_query_len, s.gating.cost_model, s.gating.max_density, s.gating.enabled) == \
        (512, False, 1.0, True)
    # a copy changed by a grouped setting's flat name changes it (pydantic's copy alone would not)
    for copy in (s.replace(max_density=0.25), s.model_copy(update={"max_density": 0.25})):
        assert copy.gating.max_density == 0.25 and copy.gating.min_sparse_query_len == 512
        assert not hasattr(copy, "max_density")
    with pytest.raises(ValueError, match=r"gating\.max_density"):
        s.replace(max_density=0)  # validated
    with pytest.raises(ValueError, match=r"gating\.exact_prompt_end\n  Input should be greater than or equal to 0"):
        s.replace(exact_prompt_end=-8192)
    assert s.replace(exact_prompt_end=8192).gating.exact_prompt_end == 8192
    s = SparseSettings(gating=GatingSettings(min_sparse_query_len=8), max_density=0.3)
    assert (s.gating.min_sparse_query_len, s.gating.max_density) == (8, 0.3)


def test_decode_settings_by_variable_flat_key_and_nested_key(tmp_path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"decode_span_theta": 0.8, "decode": {"mode": "spans", "spans": {"iou": 0.2}}}))
    s = load_checked_settings({"VLLM_SPARSE_CONFIG": str(f), "VLLM_SPARSE_DECODE_TOPK_TOKENS": "5"})
    assert (s.decode.mode, s.decode.spans.theta, s.decode.spans.iou, s.decode.topk.tokens) == ("spans", 0.8, 0.2, 5)
    assert s.decode.spans.index_lambda == 3.0
    f.write_text(json.dumps({"decode": {"spans": {"iou": 2}}}))
    with pytest.raises(ConfigError, match=r"field 'decode\.spans\.iou': Input should be less than or equal to 1"):
        load_settings({"VLLM_SPARSE_CONFIG": str(f)})
    # a check across fields of a group sees flat and nested names alike
    f.write_text(json.dumps({"decode_persist_next": 2, "decode": {"spans": {"persist": "index"}}}))
    with pytest.raises(ConfigError, match="field 'decode.spans': Value error, decode_persist_next runs"):
        load_settings({"VLLM_SPARSE_CONFIG": str(f)})

# Every pattern setting's name before issue 52 grouped them (its variable's suffix and flat JSON
# key), its nested place now, and a value other than the default.
PATTERN_SETTINGS = {
    "vertical_size": ("vertical_slash", "vertical_size", 250), "slash_size": ("vertical_slash", "slash_size", 500),
    "vertical_share": ("vertical_slash", "vertical_share", 0.1), "slash_share": ("vertical_slash", "slash_share", 0.2),
    "slash_band": ("vertical_slash", "slash_band", 64), "slash_tiles": ("vertical_slash", "slash_tiles", "ranges"),
    "last_q": ("vertical_slash", "last_q", 32), "keep_first_columns": ("vertical_slash", "keep_first_columns", 4),
    "keep_last_diagonals": ("vertical_slash", "keep_last_diagonals", 5),
    "topk_blocks": ("block_sparse", "topk_blocks", 8), "block_scoring": ("block_sparse", "scoring", "sampled"),
    "block_samples": ("block_sparse", "samples", 4), "antidiagonal_stride": ("block_sparse", "antidiagonal_stride", 8),
    "block_mass": ("block_sparse", "block_mass", 0.9),
    "sink_tokens": ("a_shape", "sink_tokens", 64), "local_window": ("a_shape", "local_window", 512),
    "gamma": ("flex_prefill", "gamma", 0.9), "tau": ("flex_prefill", "tau", 0.2),
    "flex_block_size": ("flex_prefill", "block_size", 64), "min_budget": ("flex_prefill", "min_budget", 256),
    "max_budget": ("flex_prefill", "max_budget", 4096),
}


def test_pattern_settings_keep_their_variables_and_flat_json_keys(tmp_path):
    by_env = load_checked_settings({f"VLLM_SPARSE_{name.upper()}": str(value)
                                    for name, (_, _, value) in PATTERN_SETTINGS.items()})
    for name, (pattern, field, value) in PATTERN_SETTINGS.items():
        assert getattr(getattr(by_env.patterns, pattern), field) == value, name
    f = tmp_path / "s.json"
    f.write_text(json.dumps({name: value for name, (_, _, value) in PATTERN_SETTINGS.items()}))
    assert load_checked_settings({"VLLM_SPARSE_CONFIG": str(f)}) == by_env
    nested: dict = {}
    for pattern, field, value in PATTERN_SETTINGS.values():
        nested.setdefault(pattern, {})[field] = value
    f.write_text(json.dumps({"patterns": nested}))
    assert load_checked_settings({"VLLM_SPARSE_CONFIG": str(f)}) == by_env
    # a copy by flat name changes the nested field; a group's own check sees flat and nested alike
    assert SparseSettings().replace(flex_block_size=64).patterns.flex_prefill.block_size == 64
    f.write_text(json.dumps({"min_budget": 2048, "patterns": {"flex_prefill": {"max_budget": 1024}}}))
    with pytest.raises(ConfigError, match="field 'patterns.flex_prefill': Value error, max_budget=1024 is below"):
        load_settings({"VLLM_SPARSE_CONFIG": str(f)})


def test_a_head_takes_the_parameters_its_entry_leaves_out_from_its_patterns_settings():
    s = SparseSettings(**{name: value for name, (_, _, value) in PATTERN_SETTINGS.items()})
    want = {"dense": (), "vertical_slash": (("vertical_size", 250), ("slash_size", 500)),
            "a_shape": (("sink_tokens", 64), ("local_window", 512)), "block_sparse": (("topk_blocks", 8),),
            "flex_prefill": (("gamma", 0.9),)}
    assert {p: resolve_head(HeadPattern(pattern=p), s).params for p in want} == want
    assert resolve_head(HeadPattern(pattern="a_shape", sink_tokens=7), s).params == \
        (("sink_tokens", 7), ("local_window", 512))


def _head_file(num_layers=2, num_heads=3):
    return {
        "format": "vllm-sparse-head-config", "version": 1, "model": "toy", "num_layers": num_layers,
        "num_heads": num_heads, "produced_by": "test",
        "layers": [{"heads": [{"pattern": "vertical_slash", "vertical_size": 100 + h, "slash_size": 800}
                              for h in range(num_heads)]} for _ in range(num_layers)],
    }


def test_head_config_round_trip_and_resolution(tmp_path):
    data = _head_file()
    data["layers"][1]["heads"][2] = {"pattern": "a_shape", "sink_tokens": 64}
    p = tmp_path / "toy.json"
    p.write_text(json.dumps(data))
    cfg = load_head_config(p)
    save_head_config(cfg, tmp_path / "again.json")
    assert load_head_config(tmp_path / "again.json") == cfg
    s = SparseSettings(local_window=999)
    heads = layer_heads(cfg, s, 1, 3)
    assert [h.pattern for h in heads] == ["vertical_slash"] * 2 + ["a_shape"]
    assert heads[0].param("vertical_size") == 100 and heads[2].param("sink_tokens") == 64
    assert heads[2].param("local_window") == 999  # left out of the file: the setting
    # tensor parallel: rank 1 of 3 local heads... of a 3-head layer with 1 head per rank
    assert layer_heads(cfg, s, 0, 1, tp_rank=2)[0].param("vertical_size") == 102
    assert layer_heads(None, s, 7, 4) == [resolve_head(None, s)] * 4


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: d["layers"][1]["heads"][2].update(slash_size=0), r"layer 1, head 2, field 'slash_size'"),
    (lambda d: d["layers"][0]["heads"][1].update(pattern="diagonal"), r"layer 0, head 1, field 'pattern'"),
    (lambda d: d["layers"][1]["heads"][0].update(vertical=5), r"layer 1, head 0, field 'vertical'"),
    (lambda d: d["layers"][1]["heads"].pop(), r"layer 1: 'heads' has 2 entries but num_heads is 3"),
    (lambda d: d.update(num_layers=5), r"'layers' has 2 entries but num_layers is 5"),
    (lambda d: d.update(format="minference"), r"field 'format'"),
])
def test_malformed_head_config_names_file_layer_head_field(tmp_path, mutate, needle):
    data = _head_file()
    mutate(data)
    p = tmp_path / "broken.json"
    p.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as e:
        load_head_config(p)
    assert "broken.json" in str(e.value)
    assert __import__("re").search(needle, str(e.value)), str(e.value)


def test_head_config_shape_checks_at_use():
    cfg = HeadConfigFile.model_validate(_head_file())
    with pytest.raises(ConfigError, match="layer 4 requested"):
        layer_heads(cfg, SparseSettings(), 4, 3)
    with pytest.raises(ConfigError, match="rank 1 needs heads 3..5"):
        layer_heads(cfg, SparseSettings(), 0, 3, tp_rank=1)


def test_import_minference_format():
    mi = [{"0": ["vertical_and_slash", 1000, 6096, 0.91], "1": ["stream_llm", 100, 800, 0.5],
           "2": ["block_sparse", 8, 1, 0.2]},
          {"0": ["vertical_and_slash", 30, 800, 0.9], "1": ["vertical_and_slash", 3500, 100, 0.8],
           "2": ["vertical_and_slash", 500, 700, 0.7]}]
    cfg = import_minference(mi, "toy")
    assert (cfg.num_layers, cfg.num_heads) == (2, 3)
    h = cfg.layers[0].heads
    assert h[0] == HeadPattern(pattern="vertical_slash", vertical_size=1000, slash_size=6096, score=0.91)
    assert h[1] == HeadPattern(pattern="a_shape", sink_tokens=100, local_window=800, score=0.5)
    assert h[2].pattern == "block_sparse" and h[2].params == {}
    assert cfg.layers[1].heads[1].vertical_size == 3500


@pytest.mark.parametrize("bad,needle", [
    ({"x": 1}, "non-empty JSON list"),
    ([{"0": ["vertical_and_slash", 10, 10, 0.1], "1": ["dilated", 1, 1, 0.1]}], r"layer 0, head 1, field 'pattern'"),
    ([{"0": ["vertical_and_slash", 10, 10, 0.1]}, {"0": ["vertical_and_slash", -1, 10, 0.1]}],
     r"layer 1, head 0, field 'vertical_size'"),
    ([{"0": ["vertical_and_slash", 10, 10]}], r"layer 0, head 0: expected \[pattern"),
    ([{"0": ["vertical_and_slash", 10, 10, 0.1]}, {"0": ["vertical_and_slash", 1, 1, 1], "1": ["stream_llm", 1, 1, 1]}],
     "layer 1: 2 heads, layer 0 has 1"),
])
def test_import_minference_errors(bad, needle):
    with pytest.raises(ConfigError, match=needle):
        import_minference(bad, "toy", source="mi.json")


def test_cli_import_and_check(tmp_path, capsys):
    from vllm_sparse_tools.cli import main
    src = tmp_path / "mi.json"
    src.write_text(json.dumps([{"0": ["vertical_and_slash", 100, 800, 0.5], "1": ["stream_llm", 64, 512, 0.1]}]))
    out = tmp_path / "ours.json"
    assert main(["import-minference", str(src), str(out), "--model", "toy"]) == 0
    assert main(["check-head-config", str(out)]) == 0
    assert "OK (toy, 1 layers x 2 heads)" in capsys.readouterr().out
    src.write_text(json.dumps([{"0": ["vertical_and_slash", 100, 800]}]))
    assert main(["import-minference", str(src), str(out), "--model", "toy"]) == 2
    assert "layer 0, head 0" in capsys.readouterr().err


def test_shipped_head_config_loads_by_name():
    """VLLM_SPARSE_HEAD_CONFIG=smollm2-135m-instruct resolves the file shipped in head_configs/."""
    from vllm_sparse_backend.head_configs import resolve_head_config

    cfg = resolve_head_config("smollm2-135m-instruct")
    assert (cfg.model, cfg.num_layers, cfg.num_heads) == ("SmolLM2-135M-Instruct", 30, 9)
    assert cfg.produced_by.startswith("vllm-sparse search-patterns")
    assert all(h.score is not None for layer in cfg.layers for h in layer.heads)


def _model_dir(tmp_path, layers=2, heads=3, kv_heads=None):
    d = tmp_path / f"model-{layers}-{heads}-{kv_heads}"
    d.mkdir()
    cfg = {"num_hidden_layers": layers, "num_attention_heads": heads}
    if kv_heads is not None:
        cfg["num_key_value_heads"] = kv_heads
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_head_config_checked_against_the_model_shape(tmp_path):
    from vllm_sparse_backend.head_configs import check_fits_model, read_model_shape

    cfg = HeadConfigFile.model_validate({**_head_file(), "num_kv_heads": 3})
    check_fits_model(cfg, read_model_shape(_model_dir(tmp_path)), "toy.json")  # no KV heads: one per query head
    with pytest.raises(ConfigError) as e:
        check_fits_model(cfg, read_model_shape(_model_dir(tmp_path, layers=3, heads=6, kv_heads=2)), "toy.json")
    lines = str(e.value).splitlines()[1:]
    assert lines[0].startswith("toy.json: field 'num_layers': 2, but ") and "has 3 layers" in lines[0]
    assert lines[1].startswith("toy.json: field 'num_heads': 3, but ") and "has 6 query heads" in lines[1]
    assert lines[2].startswith("toy.json: field 'num_kv_heads': 3, but ") and "has 2 KV heads" in lines[2]
    with pytest.raises(ConfigError, match="not a Hugging Face model folder"):
        read_model_shape(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4}))
    with pytest.raises(ConfigError, match=r"config\.json: field 'num_hidden_layers': expected a positive integer"):
        read_model_shape(tmp_path)
    with pytest.raises(ConfigError, match="num_heads=3 is not a multiple of num_kv_heads=2"):
        parse_head_config({**_head_file(), "num_kv_heads": 2}, "odd.json")


def test_per_kv_group_file_on_another_gqa_layout_is_refused(tmp_path):
    """A file searched per KV group (4 heads, 2 groups of 2, uniform within each) on a model
    whose 4 query heads share one KV head: the file's groups split the model's group."""
    from vllm_sparse_backend.head_configs import check_fits_model, read_model_shape

    data = _head_file(num_heads=4)
    for layer in data["layers"]:
        layer["heads"] = [{"pattern": "vertical_slash", "vertical_size": 100, "slash_size": 800, "score": 0.1}] * 2 + \
            [{"pattern": "a_shape", "sink_tokens": 64, "local_window": 512, "score": 0.2}] * 2
    data["settings"] = {"selection": "per_kv_group"}
    cfg = HeadConfigFile.model_validate(data)
    check_fits_model(cfg, read_model_shape(_model_dir(tmp_path, heads=4, kv_heads=2)), "g.json")
    with pytest.raises(ConfigError, match=r"g\.json: layer 0, heads 0\.\.3: field 'settings.selection' says "
                                          r"per_kv_group"):
        check_fits_model(cfg, read_model_shape(_model_dir(tmp_path, heads=4, kv_heads=1)), "g.json")


def test_cli_check_head_config_against_a_model_and_settings_check_the_file(tmp_path, capsys, monkeypatch):
    from vllm_sparse_tools.cli import main

    path = tmp_path / "toy.json"
    path.write_text(json.dumps(_head_file()))
    assert main(["check-head-config", str(path), "--model", str(_model_dir(tmp_path))]) == 0
    assert "fits" in capsys.readouterr().out
    # 31 layers for a 30-layer model, 12 heads for 9: refused, naming the file and the field
    assert main(["check-head-config", str(path), "--model", str(_model_dir(tmp_path, layers=30, heads=9))]) == 2
    err = capsys.readouterr().err
    assert f"{path}: field 'num_layers': 2, but" in err and f"{path}: field 'num_heads': 3, but" in err
    for k in [k for k in __import__("os").environ if k.startswith("VLLM_SPARSE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("VLLM_SPARSE_HEAD_CONFIG", str(tmp_path / "missing.json"))
    assert main(["settings"]) == 2
    assert "missing.json: cannot read head config" in capsys.readouterr().err
    monkeypatch.setenv("VLLM_SPARSE_HEAD_CONFIG", str(path))
    assert main(["settings"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["head_config"] == str(path) and "OK (toy, 2 layers x 3 heads)" in out.err


@pytest.mark.parametrize("field,value,want", [
    ("default_pattern", "banana", "unknown pattern 'banana' (known: dense, a_shape, vertical_slash, block_sparse, "
                                  "flex_prefill)"),
    ("decode_mode", "sparse", "unknown decode mode 'sparse' (known: dense, topk, spans)"),
    ("kv_placement", "disk", "unknown KV placement 'disk' (known: gpu, host)"),
])
def test_start_up_checks_registered_names_in_the_settings_file_and_variables(tmp_path, field, value, want):
    f = tmp_path / "s.json"
    f.write_text(json.dumps({field: value}))
    with pytest.raises(ConfigError) as err:
        load_checked_settings({"VLLM_SPARSE_CONFIG": str(f)})
    assert str(err.value) == f"{f}: field '{SETTINGS[field].key}': {want}"
    with pytest.raises(ConfigError) as err:
        load_checked_settings({"VLLM_SPARSE_" + field.upper(): value})
    assert str(err.value) == f"environment variable VLLM_SPARSE_{field.upper()}={value!r}: {want}"
