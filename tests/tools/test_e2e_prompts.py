"""benchmarks.e2e's prompts (random ids, or consecutive token ids of a text: --prompt-text) and its
server command (real weights with --model-dir, dummy ones otherwise; token ids, no tokenizer)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.e2e import prompt_ids_of, server_command, tokenize_text


def test_text_prompts_are_consecutive_ids_from_a_seeded_offset_wrapping_around():
    text_ids = list(range(100, 200))
    got = prompt_ids_of(250, 3, text_ids)
    start = (3 * 7919) % 100
    assert got[:5] == [100 + (start + i) % 100 for i in range(5)]
    assert len(got) == 250 and got[100:200] == got[:100]  # wraps around the text
    assert prompt_ids_of(8, 4, text_ids) != prompt_ids_of(8, 3, text_ids)  # each length reads other text


def test_random_prompts_without_a_text():
    a = prompt_ids_of(64, 1)
    assert a == prompt_ids_of(64, 1) and a != prompt_ids_of(64, 2)
    assert all(10 <= t < 100000 for t in a)


def test_tokenize_text_matches_the_models_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tiny_llama import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path / "tiny", vocab=1024)
    text = tmp_path / "text.txt"
    text.write_text(Path(json.__file__).read_text())
    ids = json.loads(Path(tokenize_text(str(model_dir), str(text), str(tmp_path))).read_text())
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert ids == tok.encode(text.read_text(), add_special_tokens=False)
    assert tok.decode(prompt_ids_of(len(ids), 0, ids)) == text.read_text()  # offset 0: the text itself


def _server_args(**kw):
    base = dict(model="/m", model_dir=None, backend="FLASH_ATTN", max_len=4096, chunk=2048, tensor_parallel_size=1,
                kv_cache_dtype="auto", cudagraphs=False)
    return argparse.Namespace(**{**base, **kw})


def test_server_loads_the_model_weights_only_with_model_dir():
    def load_format(cmd):
        return cmd[cmd.index("--load-format") + 1]

    assert load_format(server_command(_server_args(), 8000)) == "dummy"
    real = server_command(_server_args(model_dir="/m", model="/tmp/yarn/m"), 8000)
    assert load_format(real) == "auto" and "/tmp/yarn/m" in real
    assert "--skip-tokenizer-init" in real and "--enforce-eager" in real  # token ids in, no tokenization timed
