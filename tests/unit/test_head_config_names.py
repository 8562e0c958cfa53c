"""Head-config names and model checks outside a server: ``VLLM_SPARSE_HEAD_CONFIG`` and
``vllm-sparse check-head-config`` take the same shipped names, a name never reaches a file
outside the shipped folder, and ``vllm-sparse settings`` says whether it checked the file
against a model."""

from __future__ import annotations

import json

import pytest

from vllm_sparse_backend.config import ConfigError
from vllm_sparse_backend.head_configs import resolve_head_config, shipped_head_config_names
from vllm_sparse_tools.cli import main

SHIPPED = "smollm2-135m-instruct"  # 30 layers x 9 query heads, 3 KV heads


def _model_dir(tmp_path, layers, heads, kv_heads):
    folder = tmp_path / f"model-{layers}x{heads}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads}))
    return str(folder)


def test_shipped_names_are_the_json_files_of_head_configs():
    names = shipped_head_config_names()
    assert SHIPPED in names and "qwen2.5-coder-0.5b-instruct" in names
    assert all(not n.endswith(".json") and "/" not in n for n in names)


# "../head_configs/<name>" seen from the shipped folder is a shipped file again: a lookup that
# joined names onto the folder would read it (and any other file reachable that way).
@pytest.mark.parametrize("spec", ["../../x", "../head_configs/" + SHIPPED, "sub/name", "a..b", "..\\x",
                                  "/no/such/heads", "/" + SHIPPED, " "])
def test_a_name_with_a_separator_or_dots_that_is_no_file_is_refused(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"not a shipped head-config name \(a name is a bare file name") as e:
        resolve_head_config(spec)
    assert str(e.value).startswith(f"field 'head_config' = {spec!r}: ") and SHIPPED in str(e.value)


def test_an_existing_path_is_read_as_a_path_whatever_its_spelling(tmp_path, monkeypatch):
    shipped = resolve_head_config(SHIPPED)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "mine").write_text(json.dumps(shipped.model_dump(mode="json", exclude_none=True)))
    monkeypatch.chdir(tmp_path / "sub")
    assert resolve_head_config("../sub/mine").num_layers == shipped.num_layers


def test_an_unknown_plain_name_lists_the_shipped_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^field 'head_config' = 'nope': no such head-config file or shipped "
                       r"name \(shipped: .*"
                       + SHIPPED):
        resolve_head_config("nope")


def test_check_head_config_takes_a_shipped_name(capsys):
    assert main(["check-head-config", "qwen2.5-coder-0.5b-instruct"]) == 0
    assert capsys.readouterr().out.startswith("qwen2.5-coder-0.5b-instruct: OK (")


def test_check_head_config_checks_a_shipped_name_against_a_model(tmp_path, capsys):
    assert main(["check-head-config", SHIPPED, "--model", _model_dir(tmp_path, 30, 9, 3)]) == 0
    assert "fits" in capsys.readouterr().out
    assert main(["check-head-config", SHIPPED, "--model", _model_dir(tmp_path, 2, 4, 2)]) == 2
    err = capsys.readouterr().err
    assert f"{SHIPPED}: field 'num_layers': 30, but " in err


def test_check_head_config_refuses_a_name_outside_the_shipped_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["check-head-config", "../../x"]) == 2
    assert "'../../x': no such head-config file, and not a shipped head-config name" in capsys.readouterr().err


@pytest.fixture
def head_config_env(monkeypatch):
    import os

    for key in [k for k in os.environ if k.startswith("VLLM_SPARSE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("VLLM_SPARSE_HEAD_CONFIG", SHIPPED)


def test_settings_says_the_head_config_was_not_checked_against_a_model(head_config_env, capsys):
    assert main(["settings"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["head_config"] == SHIPPED
    assert "not checked against a model" in err and "--model DIR" in err


def test_settings_with_model_checks_the_head_config(head_config_env, tmp_path, capsys):
    assert main(["settings", "--model", _model_dir(tmp_path, 30, 9, 3)]) == 0
    assert "fits" in capsys.readouterr().err
    assert main(["settings", "--model", _model_dir(tmp_path, 2, 4, 2)]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing printed as valid
    assert "head config does not fit the model" in err and f"{SHIPPED}: field 'num_heads': 9" in err
