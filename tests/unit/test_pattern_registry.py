"""The pattern registry is the one extension point for prefill patterns: a new pattern is a
Pattern subclass plus one registry entry, and then every part of the backend that handles
patterns handles it (settings, head-config files, the planner's budget checks, both
estimators, the attention that follows), with nothing else edited.

The pattern here is a toy made for this test: each query sees only the key blocks within
``reach`` keys of its own block (an A-shape with no sink), ``reach`` being a per-head parameter
of its own that no setting has (the pattern declares it, with its bound and default). Its
selection is checked against a brute-force mask and its attention against float64 attention
under that mask.
"""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import Field, ValidationError, create_model

from vllm_sparse_backend.config import ConfigError, PatternGroup, SparseSettingsBase, read_settings
from vllm_sparse_backend.settings import PatternSettings, SparseSettings, pattern_settings_model

from vllm_sparse_backend.head_configs import HeadPattern, parse_head_config, resolve_head
from vllm_sparse_backend.prefill.budgets import budget_density, budgets_cover_every_key, kv_group_share
from vllm_sparse_backend.prefill.estimate import HeadGroups, estimate_index, estimate_index_paged
from vllm_sparse_backend.prefill.index import num_blocks, query_block_bounds
from vllm_sparse_kernels.reference.index import index_to_dense_mask
from vllm_sparse_backend.prefill.patterns import PATTERNS, get_pattern
from vllm_sparse_backend.prefill.patterns.base import (HeadParams, PagedSelection, Pattern, PatternSelection,
                                                        per_head_params)
from vllm_sparse_backend.startup import load_checked_settings
from vllm_sparse_kernels.torch_attention import sparse_attention


class LocalBlocksParams(HeadParams):
    reach: int | None = Field(100, ge=1, description="keys reached back from each query block")


class LocalBlocks(Pattern):
    """Toy pattern: the key blocks reaching back ``reach`` keys from each query block."""

    name = "local_blocks"
    head_params = LocalBlocksParams

    def keys_per_query(self, head, kv_len, visible, settings):
        return head.param("reach")

    def covers_every_key(self, head, kv_len, settings):
        return head.param("reach") >= kv_len

    def _selection(self, window: torch.Tensor, q_len: int, ctx_len: int, block_size: int) -> PatternSelection:
        q_first, q_last = query_block_bounds(q_len, ctx_len, block_size, window.device)
        kb = torch.arange(num_blocks(ctx_len + q_len, block_size), device=window.device)
        k_first, k_last = kb * block_size, kb * block_size + block_size - 1
        near = k_last[None, None, :] >= q_first[None, :, None] - window[:, None, None]
        causal = k_first[None, None, :] <= q_last[None, :, None]
        return PatternSelection.blocks_only(near & causal)

    def select(self, q, k, kvh, ctx_len, params, settings, scale, share):
        return self._selection(params["reach"], q.shape[0], ctx_len, settings.block_size), {
            self.name: q.shape[1]}

    def estimate_paged(self, q_row, key_cache, block_table_row, ctx_len, group, num_lists, settings, scale, share,
                       k_scale=None):
        q_len, b = q_row.shape[0], settings.block_size
        return PagedSelection(self._selection(group.params["reach"], q_len, ctx_len, b).to_index(
            b, q_len, ctx_len))


@pytest.fixture
def registered(monkeypatch):
    """The one line a new pattern adds to the registry (undone after the test)."""
    monkeypatch.setitem(PATTERNS, LocalBlocks.name, LocalBlocks())


def _brute_force_mask(q_len: int, ctx_len: int, window: int, block_size: int) -> torch.Tensor:
    """bool [q_len, kv_len]: causal pairs whose key block ends within ``window`` keys of the
    first query of the query's block."""
    kv_len = ctx_len + q_len
    mask = torch.zeros(q_len, kv_len, dtype=torch.bool)
    for i in range(q_len):
        pos = ctx_len + i
        block_first = ctx_len + (i // block_size) * block_size
        for key in range(pos + 1):
            key_block_last = (key // block_size) * block_size + block_size - 1
            mask[i, key] = key_block_last >= block_first - window
    return mask


def test_a_registered_pattern_is_accepted_by_settings_and_head_config_files(registered):
    settings = SparseSettings(default_pattern="local_blocks")
    assert resolve_head(None, settings).pattern == "local_blocks"
    assert load_checked_settings({"VLLM_SPARSE_DEFAULT_PATTERN": "local_blocks"}).default_pattern == "local_blocks"
    cfg = parse_head_config({"format": "vllm-sparse-head-config", "version": 1, "model": "m", "num_layers": 1,
                             "num_heads": 2, "layers": [{"heads": [{"pattern": "local_blocks", "reach": 64},
                                                                   {"pattern": "dense"}]}]}, "file.json")
    assert [h.pattern for h in cfg.layers[0].heads] == ["local_blocks", "dense"]
    # its parameter: from the entry, else its own default (the pattern has no settings group)
    assert resolve_head(cfg.layers[0].heads[0], settings).param("reach") == 64
    assert resolve_head(None, settings).param("reach") == 100
    # an entry may set only its pattern's parameters, within their bounds
    for entry, why in (({"pattern": "local_blocks", "local_window": 64}, "field 'local_window': not a parameter "
                        "of pattern 'local_blocks' \\(its parameters: reach\\)"),
                       ({"pattern": "local_blocks", "reach": 0}, "field 'reach': Input should be greater than or "
                        "equal to 1")):
        with pytest.raises(ConfigError, match="file.json: layer 0, head 0, " + why):
            parse_head_config({"format": "vllm-sparse-head-config", "version": 1, "model": "m", "num_layers": 1,
                               "num_heads": 1, "layers": [{"heads": [entry]}]}, "file.json")


class SharpParams(HeadParams):
    gamma: float | None = Field(0.5, gt=0.0, le=1.0, description="a name FlexPrefill's settings have too")


class Sharp(LocalBlocks):
    name = "sharp"
    head_params = SharpParams


def test_a_parameter_is_resolved_from_its_own_patterns_settings_only(monkeypatch):
    """A new pattern's parameter named like another pattern's setting takes none of that
    pattern's value: a head reads its own pattern's settings group (here none: the default)."""
    monkeypatch.setitem(PATTERNS, Sharp.name, Sharp())
    settings = SparseSettings(default_pattern="sharp", gamma=0.8)
    assert resolve_head(None, settings).param("gamma") == 0.5
    assert resolve_head(HeadPattern(pattern="sharp", gamma=0.25), settings).param("gamma") == 0.25


def test_every_settings_group_of_a_pattern_is_named_as_a_registered_pattern():
    """A group named otherwise would feed no head (heads find their settings by pattern name);
    the groups are the registered patterns' own models, in the registry's order."""
    declared = {name: p.settings_model for name, p in PATTERNS.items() if p.settings_model is not None}
    assert list(PatternSettings.model_fields) == list(declared) == ["a_shape", "vertical_slash", "block_sparse",
                                                                     "flex_prefill"]
    assert {name: f.annotation for name, f in PatternSettings.model_fields.items()} == declared
    for name in PATTERNS:  # and every registered pattern's head parameters have a value
        assert resolve_head(None, SparseSettings(default_pattern=name)).pattern == name


class ReachSettings(PatternGroup):
    reach: int = Field(256, ge=1, json_schema_extra={"flat": "local_blocks_reach"},
                       description="keys reached back by heads whose entry leaves reach out")

    def check_with(self, settings) -> None:
        if self.reach % settings.block_size:
            raise ValueError(f"local_blocks_reach={self.reach}: must be a multiple of "
                             f"block_size={settings.block_size}")


class LocalBlocksWithSettings(LocalBlocks):
    settings_model = ReachSettings


def test_a_pattern_declaring_settings_gets_its_group_its_variable_and_its_checks(monkeypatch, tmp_path):
    """A pattern with settings is still its file plus the registry line: the settings are built
    from the registry (as settings.py builds SparseSettings) with its group, its flat name as a
    variable and a JSON key, its bounds and its check against the other settings."""
    monkeypatch.setitem(PATTERNS, LocalBlocks.name, LocalBlocksWithSettings())
    patterns = pattern_settings_model(PATTERNS)
    settings_class = create_model("Settings", __base__=SparseSettingsBase,
                                  patterns=(patterns, Field(default_factory=patterns, description="patterns")))
    assert list(patterns.model_fields) == [*PatternSettings.model_fields, "local_blocks"]
    s = read_settings(settings_class, {"VLLM_SPARSE_LOCAL_BLOCKS_REACH": "128", "VLLM_SPARSE_VERTICAL_SIZE": "500"})
    assert (s.patterns.local_blocks.reach, s.patterns.vertical_slash.vertical_size) == (128, 500)
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"patterns": {"local_blocks": {"reach": 192}}}))
    assert read_settings(settings_class, {"VLLM_SPARSE_CONFIG": str(path)}).patterns.local_blocks.reach == 192
    # a head whose entry leaves reach out takes the setting (not the parameter's own default, 100)
    s = settings_class(default_pattern="local_blocks", local_blocks_reach=320)
    assert resolve_head(None, s).param("reach") == 320
    assert resolve_head(None, s.replace(local_blocks_reach=64)).param("reach") == 64
    assert resolve_head(HeadPattern(pattern="local_blocks", reach=32), s).param("reach") == 32
    with pytest.raises(ConfigError, match="VLLM_SPARSE_LOCAL_BLOCKS_REACH='0'"):
        read_settings(settings_class, {"VLLM_SPARSE_LOCAL_BLOCKS_REACH": "0"})
    with pytest.raises(ConfigError, match="local_blocks_reach=100: must be a multiple of block_size=64"):
        read_settings(settings_class, {"VLLM_SPARSE_LOCAL_BLOCKS_REACH": "100"})


def _accepts(model, name, value) -> bool:
    try:
        model(**{name: value})
    except ValidationError:
        return False
    return True


def _edges(setting) -> list:
    """Values on and just past each bound of a setting (its own constraints, read as data)."""
    step = 1 if setting.annotation is int else 1e-6
    values = []
    for bound in setting.metadata:
        for attr in ("ge", "gt", "le", "lt"):
            x = getattr(bound, attr, None)
            if x is not None:
                values += [x - step, x, x + step]
    return values


def test_every_head_parameter_named_as_a_setting_has_that_settings_bounds():
    """A head-config entry may not set a value its pattern's setting of the same name refuses,
    nor be refused one the setting takes (the bounds are declared once, on the setting)."""
    checked = []
    for name, pattern in PATTERNS.items():
        for field in pattern.head_fields:
            setting = pattern.settings_model.model_fields.get(field) if pattern.settings_model else None
            if setting is None:
                continue
            edges = _edges(setting)
            assert edges, f"{name}.{field}: a setting without bounds to compare"
            for v in edges:
                assert _accepts(pattern.head_params, field, v) == _accepts(pattern.settings_model, field, v), (
                    name, field, v)
            checked.append(f"{name}.{field}")
    assert checked == ["a_shape.sink_tokens", "a_shape.local_window", "vertical_slash.vertical_size",
                       "vertical_slash.slash_size", "block_sparse.topk_blocks", "flex_prefill.gamma"]


@pytest.mark.parametrize("least", [8, 40])
def test_a_new_patterns_head_parameter_follows_its_setting_bound(monkeypatch, least):
    """A pattern whose head parameter is made from its setting (per_head_params): move the
    setting's bound and a head-config file is held to the new one, named by file and field."""
    settings_model = create_model("ReachSettings", __base__=PatternGroup, reach=(int, Field(
        256, ge=least, json_schema_extra={"flat": "local_blocks_reach"}, description="keys reached back")))

    class Reach(LocalBlocks):
        head_params = per_head_params(settings_model, "reach")

    monkeypatch.setitem(PATTERNS, LocalBlocks.name, Reach())

    def entry(reach):
        return parse_head_config({"format": "vllm-sparse-head-config", "version": 1, "model": "m", "num_layers": 1,
                                  "num_heads": 1, "layers": [{"heads": [{"pattern": "local_blocks", "reach": reach}]}]},
                                 "file.json").layers[0].heads[0]

    assert entry(least).params == {"reach": least}
    with pytest.raises(ConfigError, match=f"file.json: layer 0, head 0, field 'reach': Input should be greater than "
                                          f"or equal to {least}"):
        entry(least - 1)
    assert Reach.head_params.model_fields["reach"].description == "keys reached back"
    assert Reach.head_params().reach is None  # left out: the head takes the setting
    with pytest.raises(TypeError, match="ReachSettings has no setting 'window' \\(its settings: reach\\)"):
        per_head_params(settings_model, "window")


@pytest.mark.parametrize("value", ["1000", True, 1000.0])
def test_a_head_config_budget_must_be_a_json_integer(value):
    """A string, a boolean or a float where a budget goes is refused naming the field, not
    carried into the resolved head as it was written."""
    with pytest.raises(ConfigError, match="file.json: layer 0, head 0, field 'vertical_size': Input should be a "
                                          "valid integer"):
        parse_head_config({"format": "vllm-sparse-head-config", "version": 1, "model": "m", "num_layers": 1,
                           "num_heads": 1, "layers": [{"heads": [{"pattern": "vertical_slash",
                                                                  "vertical_size": value}]}]}, "file.json")


def test_an_unregistered_pattern_fails_naming_the_known_ones():
    with pytest.raises(ConfigError, match="local_blocks.*known: dense, a_shape"):
        load_checked_settings({"VLLM_SPARSE_DEFAULT_PATTERN": "local_blocks"})
    with pytest.raises(ConfigError, match="layer 0, head 0, field 'pattern'.*unknown pattern 'local_blocks'"):
        parse_head_config({"format": "vllm-sparse-head-config", "version": 1, "model": "m", "num_layers": 1,
                           "num_heads": 1, "layers": [{"heads": [{"pattern": "local_blocks"}]}]}, "file.json")
    with pytest.raises(KeyError, match="local_blocks"):
        get_pattern("local_blocks")


def test_the_budget_checks_ask_the_registered_pattern(registered):
    settings = SparseSettings(default_pattern="local_blocks")
    heads = [resolve_head(HeadPattern(pattern="local_blocks", reach=128), settings)] * 4
    q_len, ctx_len = 1024, 1024
    visible = ctx_len + (q_len + 1) / 2
    assert budget_density(heads, q_len, ctx_len, settings) == pytest.approx(128 / visible)
    assert not budgets_cover_every_key(heads, q_len, ctx_len, settings)
    wide = [resolve_head(HeadPattern(pattern="local_blocks", reach=4096), settings)] * 4
    assert budgets_cover_every_key(wide, q_len, ctx_len, settings)
    assert kv_group_share(heads, 2, settings) == 2  # group_shareable by default


@pytest.mark.parametrize("q_len,ctx_len", [(300, 0), (200, 150)])
def test_both_estimators_and_the_attention_follow_the_registered_pattern(registered, q_len, ctx_len, rng):
    block, window = 64, 100  # the pattern's default reach
    settings = SparseSettings(default_pattern="local_blocks", kv_group_shared=False)
    # two heads of the toy pattern beside two dense ones: the registry serves mixed layers too
    heads = [resolve_head(None, settings)] * 2 + [resolve_head(None, settings.model_copy(
        update={"default_pattern": "dense"}))] * 2
    h, hkv, d = 4, 2, 16
    q = torch.randn(q_len, h, d, generator=rng)
    k = torch.randn(ctx_len + q_len, hkv, d, generator=rng)
    v = torch.randn(ctx_len + q_len, hkv, d, generator=rng)

    est = estimate_index(q, k, ctx_len, heads, settings, d ** -0.5)
    assert est.head_patterns == {"local_blocks": 2, "dense": 2}
    mask = index_to_dense_mask(est.index, q_len, ctx_len)
    want = _brute_force_mask(q_len, ctx_len, window, block)
    causal = torch.ones(q_len, ctx_len + q_len, dtype=torch.bool).tril(ctx_len)
    assert torch.equal(mask[0], want) and torch.equal(mask[1], want)
    assert torch.equal(mask[2], causal) and torch.equal(mask[3], causal)

    # the paged estimator lists the same keys (a layer of the toy pattern only: it runs on CPU
    # tensors, where the built-in patterns' GPU estimators need triton)
    page = 16
    pages = -(-(ctx_len + q_len) // page)
    key_cache = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pages * page - k.shape[0])).view(pages, page, hkv, d)
    paged = estimate_index_paged(q, key_cache, torch.arange(pages, dtype=torch.int32), ctx_len,
                                 HeadGroups.from_heads(heads[:2] * 2, "cpu"), settings, d ** -0.5)
    assert paged.head_patterns == {"local_blocks": 4}
    assert torch.equal(index_to_dense_mask(paged.index, q_len, ctx_len), mask[:2].repeat(2, 1, 1))

    # attention over the index equals float64 attention under the brute-force mask
    out, _ = sparse_attention(q, k, v, est.index, ctx_len, d ** -0.5)
    kvh = torch.arange(h) // (h // hkv)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k[:, kvh].double()) * d ** -0.5
    allowed = torch.stack([want, want, causal, causal])
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    ref = torch.einsum("hqk,khd->qhd", probs, v[:, kvh].double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
