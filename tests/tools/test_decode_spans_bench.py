"""benchmarks/decode_spans.py: its per-case functions run at tiny sizes and return sane records.

Without CUDA: Triton's interpreter (triton_setup sets TRITON_INTERPRET=1), wall-clock timing;
1 KV head, 2 query heads, head dim 64, segments of 128 tokens, contexts of a few hundred tokens.
Skips where triton or the installed kernels are absent.
"""

from __future__ import annotations

import math

import pytest
import torch

from triton_setup import CUDA, INTERPRET, kernel_module

pytestmark = pytest.mark.kernels  # `make test` runs these with triton, under its interpreter on CPU

sd = kernel_module("decode.span_decode")
kernel_module("decode.topk_decode")
DEV = "cuda" if CUDA and not INTERPRET else "cpu"
H, HKV, D = 2, 1, 64
PARAMS = dict(segment_tokens=128)
BUDGET = dict(sink=1, recent=2, persist=2)


@pytest.fixture(scope="module")
def ds():
    from benchmarks import decode_spans

    return decode_spans


def positive(rec, keys):
    for k in keys:
        assert isinstance(rec[k], float) and math.isfinite(rec[k]) and rec[k] > 0, (k, rec[k])


@pytest.mark.parametrize("chunk,context", [(192, 0), (128, 192)])
def test_prefill_case(ds, chunk, context):
    rec = ds.prefill_case(H, HKV, D, chunk, context, DEV, params=sd.SpanParams(**PARAMS), last_q=8,
                          budget_ms=1.0, max_reps=1, **BUDGET)
    positive(rec, ("plan_host", "update", "maps", "divide", "gather", "build", "mark", "spans_total", "dense", "ratio"))
    pages = -(-chunk // 16)
    assert rec["segments"] == -(-pages // 8)
    assert rec["dense_mask"] == ("causal" if context == 0 else "causal lower-right")
    assert 1 <= rec["spans_per_segment"] <= rec["pages_per_segment"] <= 8
    assert 6 <= rec["index_per_span"] <= 24  # min_index .. max_index (spans hold >= 16 tokens)
    assert rec["persist_flags"] == HKV * BUDGET["persist"]
    assert rec["spans_total"] == pytest.approx(rec["update"] + rec["build"] + rec["mark"])
    assert ds.prefill_row(rec).count("|") == len(ds.PREFILL_COLS) + 1


@pytest.mark.parametrize("fill,batch,n", [("build", 1, 256), ("random", 2, 400)])
def test_decode_case(ds, fill, batch, n):
    rec = ds.decode_case(H, HKV, D, n, batch, DEV, params=sd.SpanParams(**PARAMS), budget=4, fill=fill,
                         fill_chunk=256, last_q=8, budget_ms=1.0, max_reps=1, **BUDGET)
    positive(rec, [f"{m}_{k}" for m in ("span", "topk") for k in ("update", "select", "attn", "total")]
             + ["dense_ours", "sdpa", "fill_seconds"])
    assert rec["width"] == 9 and rec["pages"] == n // 16 and rec["fill"] == fill
    assert min(v for k, v in rec.items() if k.startswith("err_")) < 2e-2  # dense ours vs sdpa
    assert ds.decode_row(rec).count("|") == len(ds.DECODE_COLS) + 1


@pytest.mark.skipif(CUDA, reason="the no-CUDA exit")
def test_main_without_cuda(ds, capsys):
    assert ds.main([]) == 0
    assert "CUDA is not available" in capsys.readouterr().out
