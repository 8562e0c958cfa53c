"""benchmarks/infra/pack_model.py: a model folder survives pack -> chunk copies -> unpack byte for byte."""

from __future__ import annotations

import pathlib
import shutil

import pytest


def _load():
    from benchmarks.infra import pack_model

    return pack_model


def test_pack_unpack_round_trip(tmp_path):
    pm = _load()
    model = tmp_path / "model"
    model.mkdir()
    words = bytes((i * 37) % 256 for i in range(5000))  # "bf16" words: low bytes vary, high bytes repeat
    (model / "model.safetensors").write_bytes(words)
    (model / "config.json").write_text('{"a": 1}')
    text = tmp_path / "haystack.txt"
    text.write_text("some text " * 50)
    chunks = pm.pack(model, tmp_path / "gpu", [text], chunk=1000)  # several chunks from a small folder
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


def _stage(gpu: pathlib.Path, stage: pathlib.Path, skip: set[str] = frozenset()) -> None:
    """What the GPU machine does, one call per chunk: copy the files of each mK into the stage."""
    stage.mkdir()
    for d in sorted(gpu.glob("m*")):
        if d.name not in skip:
            for f in d.iterdir():
                shutil.copy(f, stage / f.name)


def test_pack_single_files_for_a_gguf(tmp_path, monkeypatch):
    pm = _load()
    monkeypatch.setattr(pm, "CHUNK", 1000)
    gguf = tmp_path / "dl" / "model-q4_k_m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(bytes((i * 101) % 256 for i in range(4321)))
    wheel = tmp_path / "gguf-0.19.0-py3-none-any.whl"
    wheel.write_bytes(b"PK wheel")
    text = tmp_path / "austen.txt"
    text.write_text("Emma Woodhouse, handsome, clever, and rich\n" * 5)
    gpu = tmp_path / "gpu"
    assert pm.main(["pack", "--files", str(gguf), "--out", str(gpu), "--extra", str(wheel), str(text)]) == 0
    assert len(list(gpu.glob("m*"))) == 5  # 4321 + 8 + 215 bytes, raw
    folders = sorted(gpu.glob("m*"), key=lambda d: int(d.name[1:]))
    # every folder within CHUNK; the manifest rides with the last one, next to the extras
    assert all(sum(f.stat().st_size for f in d.iterdir()) <= 1000 for d in folders[:-1])
    assert [f.name for f in folders[-1].iterdir() if f.suffix == ".json"] == ["manifest.json"]
    assert not (folders[0] / "manifest.json").exists()
    _stage(gpu, tmp_path / "stage")
    names = pm.unpack(tmp_path / "stage", tmp_path / "out")
    assert names == ["model-q4_k_m.gguf", "gguf-0.19.0-py3-none-any.whl", "austen.txt"]
    for f in (gguf, wheel, text):
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes()
    # a chunk that did not come: named, nothing half-written
    _stage(gpu, tmp_path / "stage2", skip={"m2"})
    with pytest.raises(SystemExit, match="1 of 5 chunks missing: model.part002"):
        pm.unpack(tmp_path / "stage2", tmp_path / "out2")
    _stage(gpu, tmp_path / "stage3", skip={folders[-1].name})
    with pytest.raises(SystemExit, match="manifest.json missing: the last chunk"):
        pm.unpack(tmp_path / "stage3", tmp_path / "out3")
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()
    # a damaged raw chunk fails its file's sha256
    part = tmp_path / "stage" / "model.part001"
    part.write_bytes(bytes(b ^ 1 for b in part.read_bytes()))
    with pytest.raises(SystemExit, match="model-q4_k_m.gguf: sha256 mismatch"):
        pm.unpack(tmp_path / "stage", tmp_path / "out4")


def test_pack_refuses_ambiguous_inputs(tmp_path):
    pm = _load()
    a = tmp_path / "a" / "x.bin"
    b = tmp_path / "b" / "x.bin"
    for f in (a, b):
        f.parent.mkdir()
        f.write_bytes(b"x")
    with pytest.raises(SystemExit, match="two files with one name"):
        pm.pack(None, tmp_path / "gpu", [b], [a])
    with pytest.raises(SystemExit, match="either a model folder or --files"):
        pm.pack(tmp_path / "a", tmp_path / "gpu", [], [a])
    with pytest.raises(SystemExit, match="either a model folder or --files"):
        pm.pack(None, tmp_path / "gpu", [], [])
    assert not (tmp_path / "gpu").exists()
