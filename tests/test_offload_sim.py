"""benchmarks/offload_sim.py: the transfer-budget arithmetic against hand-computed cases."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("offload_sim", ROOT / "benchmarks" / "offload_sim.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def test_llama_kv_bytes_per_token(sim):
    # 32 layers x 8 KV heads x (K + V) x 128 dims x 2 bytes
    assert sim.LLAMA3_8B.kv_bytes_per_token() == 32 * 8 * 2 * 128 * 2 == 131072


def test_pages_and_transfer(sim):
    shape = sim.Shape(layers=2, kv_heads=3, head_dim=4, params=1e6)
    step = sim.Step(context=1000, topk_frac=0.08, page=10, utilisation=0.5, hit=0.75)
    # 80 selected keys at half-full pages of 10 -> 16 pages per (layer, head)
    assert sim.pages_per_head(step) == pytest.approx(16.0)
    # misses: 16 x 0.25 = 4 pages; a page of one head = 10 x (K + V) x 4 dims x 2 B = 160 B
    assert sim.transfer_bytes(shape, step) == pytest.approx(2 * 3 * 4 * 160)
    assert sim.transfer_bytes(shape, sim.Step(1000, 0.08, 10, 0.5, 1.0)) == 0


def test_resident_memory(sim):
    shape = sim.Shape(layers=2, kv_heads=3, head_dim=4, params=1e6)
    step = sim.Step(context=1000, topk_frac=0.08, page=10, utilisation=0.5, hit=0.75)
    mem = sim.resident_bytes(shape, step, weight_bytes=1.0, window=50, cache_factor=2.0, summary_bytes=8)
    assert mem["weights"] == 1e6
    assert mem["window"] == 50 * 2 * 3 * 2 * 4 * 2
    assert mem["page cache"] == pytest.approx(2 * 3 * 2.0 * 16 * 160)
    assert mem["summaries"] == 2 * 3 * 100 * 8


def test_main_prints_a_row_per_point(sim, capsys):
    sim.main(["--contexts", "131072", "--topk", "0.01", "--hit", "0.5", "0.9"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 128K")]
    assert len(rows) == 2
