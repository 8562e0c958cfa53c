"""Command-line names of the evaluation's inputs (evaluation/inputs.py): model folders, texts,
variant lists with the searched head config. Nothing is fetched: the asset functions are stubbed
where a name would fetch."""

from __future__ import annotations

import argparse
import json

import pytest

from vllm_sparse_tools import assets
from vllm_sparse_tools.evaluation import inputs


def test_resolve_model_by_name_or_folder(tmp_path, monkeypatch):
    monkeypatch.setitem(assets.ASSETS, "qwen-coder", lambda: tmp_path / "q")
    assert inputs.resolve_model("qwen-coder") == (tmp_path / "q", "Qwen2.5-Coder-0.5B-Instruct")
    folder = tmp_path / "My-Model"
    folder.mkdir()
    with pytest.raises(ValueError,
                       match="neither one of smollm2, qwen-coder, qwen-coder-1.5b nor a folder"):
        inputs.resolve_model(str(folder))
    (folder / "config.json").write_text(json.dumps({}))
    assert inputs.resolve_model(str(folder)) == (folder, "My-Model")
    assert inputs.short_model_name("qwen-coder", "Qwen2.5-Coder-0.5B-Instruct") == "qwen-coder"
    monkeypatch.setitem(assets.ASSETS, "qwen-coder-1.5b", lambda: tmp_path / "q15")
    assert inputs.resolve_model("qwen-coder-1.5b") == (tmp_path / "q15",
                                                       "Qwen2.5-Coder-1.5B-Instruct")
    assert inputs.short_model_name("qwen-coder-1.5b", "x") == "qwen-coder-1.5b"
    assert inputs.short_model_name(str(folder), "My-Model") == "My-Model"


def test_resolve_text_by_name_or_file(tmp_path, monkeypatch):
    (tmp_path / "bible.txt").write_text("In the beginning\n", encoding="utf-8")
    monkeypatch.setitem(assets.ASSETS, "bible", lambda: tmp_path / "bible.txt")
    assert inputs.resolve_text("bible") == ("In the beginning\n", "bible.txt")
    (tmp_path / "mine.txt").write_bytes(b"caf\xc3\xa9 \xff")  # an invalid byte is replaced
    assert inputs.resolve_text(str(tmp_path / "mine.txt")) == ("caf\u00e9 \ufffd", "mine.txt")
    with pytest.raises(ValueError, match="neither one of austen, shakespeare, bible, text nor"):
        inputs.resolve_text(str(tmp_path / "missing.txt"))


def test_choose_variants_adds_the_searched_file_to_default_lists(tmp_path):
    configs = tmp_path / "head_configs"
    configs.mkdir()
    model_dir = tmp_path / "smollm2-135m-instruct"
    chosen = inputs.choose_variants(["dense", "vs"], model_dir, "SmolLM2-135M-Instruct", configs)
    assert [v.label for v in chosen] == ["dense", "vs"]
    with pytest.raises(ValueError, match="no head config for SmolLM2-135M-Instruct"):
        inputs.choose_variants(["searched"], model_dir, "SmolLM2-135M-Instruct", configs)
    (configs / "smollm2-135m-instruct.json").write_text("{}")
    chosen = inputs.choose_variants(["dense", "vs"], model_dir, "SmolLM2-135M-Instruct", configs)
    assert [v.label for v in chosen] == ["dense", "vs"]  # an explicit list is taken as it is
    chosen = inputs.choose_variants(["dense", "vs"], model_dir, "SmolLM2-135M-Instruct", configs,
                                    add_searched=True)
    assert [v.label for v in chosen] == ["dense", "vs", "searched"]
    assert chosen[2].overrides == {"head_config": str(configs / "smollm2-135m-instruct.json")}
    # asked for explicitly: where it was asked, once
    chosen = inputs.choose_variants(["searched", "dense"], model_dir, "x", configs,
                                    add_searched=True)
    assert [v.label for v in chosen] == ["searched", "dense"]
    with pytest.raises(ValueError, match="labels must be unique"):
        inputs.choose_variants(["vs", "vs=vertical_size=10"], model_dir, "x", tmp_path)


def test_arguments_default_to_the_presets_plus_searched(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (tmp_path / "text.txt").write_text("Some text.")
    (tmp_path / "m.json").write_text("{}")
    parser = argparse.ArgumentParser()
    inputs.add_arguments(parser, ["dense", "vs"], tmp_path)
    common = ["--model", str(model_dir), "--text", str(tmp_path / "text.txt")]
    run = inputs.from_arguments(parser, parser.parse_args(common))
    assert [v.label for v in run.variants] == ["dense", "vs", "searched"]
    assert (run.model_dir, run.model_name, run.short_name) == (model_dir, "m", "m")
    assert (run.text, run.text_name) == ("Some text.", "text.txt")
    run = inputs.from_arguments(parser, parser.parse_args(common + ["--variants", "flex0.9"]))
    assert [v.label for v in run.variants] == ["flex0.9"]
    with pytest.raises(SystemExit):  # a bad name is a usage error
        inputs.from_arguments(parser, parser.parse_args(common + ["--variants", "nope"]))
