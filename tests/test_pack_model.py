"""benchmarks/pack_model.py: a model folder survives pack -> chunk copies -> unpack byte for byte."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("pack_model", ROOT / "benchmarks" / "pack_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pack_unpack_round_trip(tmp_path, monkeypatch):
    pm = _load()
    monkeypatch.setattr(pm, "CHUNK", 1000)  # several chunks from a small folder
    model = tmp_path / "model"
    model.mkdir()
    words = bytes((i * 37) % 256 for i in range(5000))  # "bf16" words: low bytes vary, high bytes repeat
    (model / "model.safetensors").write_bytes(words)
    (model / "config.json").write_text('{"a": 1}')
    text = tmp_path / "haystack.txt"
    text.write_text("some text " * 50)
    chunks = pm.pack(model, tmp_path / "gpu", [text])
    assert chunks == len(list((tmp_path / "gpu").glob("m*"))) > 2
    stage = tmp_path / "stage"
    stage.mkdir()
    for d in (tmp_path / "gpu").glob("m*"):
        for f in d.iterdir():
            shutil.copy(f, stage / f.name)
    names = pm.unpack(stage, tmp_path / "out")
    assert sorted(names) == ["config.json", "haystack.txt", "model.safetensors"]
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == words
    assert (tmp_path / "out" / "haystack.txt").read_text() == text.read_text()
    # a damaged chunk stops the unpacking with a clear error, whichever part it hits
    for k, part in enumerate(sorted(stage.glob("model.part*"))):
        good = part.read_bytes()
        part.write_bytes(bytes(b ^ 0x5A for b in good))
        with pytest.raises(SystemExit, match="missing or damaged"):
            pm.unpack(stage, tmp_path / f"bad{k}")
        part.write_bytes(good)
