"""Accuracy of the decode modes (dense, top-k pages, span retrieval) on a real model, with a budget sweep.

Issue 8, item 3: how much of a model's long-context quality does decode-side retrieval keep, as a
function of its budget (the Quest / retrieval papers report k of about 1% of the context keeping
at least 95% of full quality)? vLLM's CPU build cannot run the backend's top-k decode (its paged
cache is not readable from Python), so this benchmark applies the same selection math in
transformers on CPU, from the float64 references that the Triton kernels are tested against
(``vllm_sparse_kernels/decode/topk_decode.py``: ``reference_page_summaries``,
``reference_select_pages``, ``reference_topk_decode_attention``).

Method. The prompts are those of ``benchmarks/accuracy.py`` (``evaluation.tasks``: the same
tasks, seeds, needle depths and chat-formatted token ids, text from the offline Austen asset).
Per prompt, transformers (fp32, SDPA) prefills once, densely, and keeps the cache; the first
token comes from that prefill. Then each variant decodes greedily from its own deep copy of the
cache, up to the task's ``max_tokens`` (what the harness asks vLLM for) and stopping at the
model's end-of-sequence tokens (vLLM's: the generation config's and the tokenizer's), with the
attention of every decode step computed by the variant's *selector* (a registered
``transformers.AttentionInterface`` function dispatches to it). So all variants share one prefill
(the expensive part: about 70 s at 8K tokens on 2 CPU threads) and differ only in decode.

Selectors (:class:`DecodeSelector`; ``SELECTORS`` maps a spec's name to its class):

* ``dense``: exact softmax over the whole cache (float64). Every decode call is compared with the
  model's own SDPA output: the run's largest relative difference (per layer in the JSON) must stay
  at most 1e-4 (fp32 SDPA itself rounds: 2.4e-5 seen, while this selector is within 4e-8 of float64
  attention), else the program exits with status 1 after writing its results; a call off by more
  than 1e-3 (a wrong layout, scale or GQA map) stops it at once.
* ``topk``: the backend's ``decode_mode=topk`` at batch 1. The layer's cache is laid out as
  pages of ``page`` tokens (identity block table, the last page padded with NaN, excluded by
  ``seq_lens``); per-page key min/max summaries are built after the prefill and the grown last
  page re-summarised each step; every KV head keeps the first ``sink`` and last ``recent`` pages
  and the ``budget`` pages of highest Quest bound (its query heads' bounds summed), optionally only
  the ``tokens`` best keys per query head of the budget pages.
* ``spans``: the backend's ``decode_mode=spans`` (Ltri-LLM) at batch 1, the prompt prefilled as one
  chunk: local maps of 1024-token segments (torch), the division's loop reference
  (``span_decode.reference_divide``, which the GPU kernels are tested to equal) and span keys,
  ``persist`` pages flagged from the last 64 prompt queries, the fallback key of each page decode
  writes to, then ``reference_select_span_pages`` and the top-k attention reference. Keys
  ``sink``, ``recent``, ``persist`` (16), ``budget`` or ``share``, ``page``, ``score`` (``sum`` as the
  backend, or ``mean``), ``index`` (the backend's ``decode_span_index``:
  ``span``, or ``page``, every page keyed by its own most-voted token; issue 24), ``persist_by``
  (``index``, the backend's: the persistent pages are those the last 64 prompt queries score highest by the same index decode uses; ``attention``: those that
  get the most of the last 64 prompt queries' exact attention, the last chunk's retrieval when the
  whole cache stays on the GPU; issue 24).

Variant specs: ``NAME[:KEY=VALUE,...]``, the spec is the variant's label. ``topk`` keys: ``sink``
(default 1 page), ``recent`` (8), ``budget`` (64) or ``share`` (budget as a share of the prompt's
tokens: ceil(share x prompt tokens / page) pages per prompt), ``tokens`` (0 = every key of the
chosen pages), ``page`` (16); defaults are the backend's (``decode_*`` in
``vllm_sparse_backend/config.py``). Examples: ``dense``, ``topk:budget=16``,
``topk:budget=64,tokens=256``, ``topk:share=0.01``.

Per task and length the table gives, per variant: the mean score (``tasks.score``), the mean
share of the context attended per decode call (keys attended per query head / context length,
over layers and steps, from the selection counts: sink and recent pages included) and the share
of prompts whose output equals the first variant's (normally dense); then the overall means over
all prompts and each variant's overall score relative to dense. Every decode call also compares
the variant's attention output with exact attention over the same cache (``out err``: relative
L2 error, mean over layers and steps; in the JSON).

    PYTHONPATH=.venv/kernel-site python -m benchmarks.decode_accuracy --model qwen-coder \\
        --lengths 8192 --samples 2 --variants dense topk:share=0.005 topk:share=0.01 \\
        topk:share=0.02 topk:share=0.05 topk:budget=64

(``topk`` imports ``vllm_sparse_kernels.decode.topk_decode``, whose module imports triton: on a
CPU machine put the kernel site on ``PYTHONPATH``; no kernel is launched.) Writes ``<out>.json``
(settings, versions, command line, timings, and per prompt and variant the output text, score,
attended share, budget, output error and decode time; rewritten after each prompt) and
``<out>.txt`` (the table); default ``<out>`` is
``benchmarks/results/decode_accuracy_cpu_<model>_<lengths>_<date>``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import fractions
import json
import math
import pathlib
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol, Sequence

if not __package__:
    raise SystemExit("run from the repository root: python -m benchmarks.decode_accuracy ...")

import torch  # noqa: E402

from vllm_sparse_backend.settings import SparseSettings  # noqa: E402
from vllm_sparse_backend.decode.topk import TopkDecodeBudget  # noqa: E402
from vllm_sparse_tools.evaluation import accuracy as acc  # noqa: E402
from vllm_sparse_tools.evaluation.tasks import score  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
_ATTENTION_NAME = "vllm_sparse_decode_accuracy"
DEFAULT_BUDGET = TopkDecodeBudget.from_settings(SparseSettings())  # the backend's decode_* defaults
DEFAULT_PAGE_SIZE = 16  # vLLM's default block size
DENSE_CHECK_RTOL = 1e-4  # dense selector vs the model's fp32 SDPA (which rounds: 2.4e-5 seen): the run's maximum
DENSE_ABORT_RTOL = 1e-3  # ... and a decode call this far off stops the run at once (a wrong layout, scale or GQA map)
PREFILL_CHECK_RTOL = 1e-4  # the last prompt row recomputed from the q/k/v handed to prefill()


# ---------------------------------------------------------------------------------------------
# Selectors
# ---------------------------------------------------------------------------------------------

class AttendedShare:
    """Running mean, over decode calls (layers x steps), of keys attended per query head divided
    by the context length."""

    def __init__(self) -> None:
        self.total = 0.0
        self.calls = 0

    def add(self, keys_per_head: float, context: int) -> None:
        self.total += keys_per_head / context
        self.calls += 1

    @property
    def mean(self) -> float | None:
        return self.total / self.calls if self.calls else None


class DecodeSelector(Protocol):
    """One decode mode for one prompt. Built per prompt (budgets may depend on its length); its
    ``prefill`` is called during the shared prefill, then ``attend`` at every decode step."""

    label: str
    attended: AttendedShare  # ``attend`` adds one entry per call

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Once per layer: the prompt's post-RoPE q [H, N, D], k / v [Hkv, N, D] (fp32, CPU)."""
        ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """One decode step of one layer: q [H, D]; the layer's whole cache k / v [Hkv, L, D], the
        step's own token last. Returns the attention output [H, D]."""
        ...


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 softmax(q k^T scale) v of one query per head over every key: q [H, D], k / v
    [Hkv, L, D], query head h reads KV head h // (H // Hkv) -> [H, D]."""
    h, d = q.shape
    hkv = k.shape[0]
    qg = q.double().view(hkv, h // hkv, d)
    p = torch.softmax(torch.einsum("kgd,kld->kgl", qg, k.double()) * scale, -1)
    return torch.einsum("kgl,kld->kgd", p, v.double()).reshape(h, d)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


class DenseSelector:
    """Exact attention over the whole cache."""

    PARAMS: ClassVar[dict[str, type]] = {}

    def __init__(self, label: str = "dense"):
        self.label = label
        self.attended = AttendedShare()

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        pass

    @classmethod
    def build(cls, label: str, params: dict[str, Any], prompt_tokens: int) -> "DenseSelector":
        return cls(label)

    def prefill(self, layer, q, k, v) -> None:
        pass

    def attend(self, layer, q, k, v, scale) -> torch.Tensor:
        self.attended.add(k.shape[1], k.shape[1])
        return exact_attention(q, k, v, scale).to(q.dtype)


def paged_cache(x: torch.Tensor, page_size: int) -> torch.Tensor:
    """One sequence's keys or values [Hkv, L, D] as a paged cache [ceil(L / page), page, Hkv, D]
    whose page i is physical page i; the last page's unused slots hold NaN."""
    hkv, length, d = x.shape
    n_pages = -(-length // page_size)
    padded = x.new_full((hkv, n_pages * page_size, d), float("nan"))
    padded[:, :length] = x
    return padded.view(hkv, n_pages, page_size, d).permute(1, 2, 0, 3)


def identity_block_table(n_pages: int) -> torch.Tensor:
    return torch.arange(n_pages, dtype=torch.int32)[None]


def budget_pages_for_share(share: float, prompt_tokens: int, page_size: int) -> int:
    """ceil(share x prompt_tokens / page_size), with ``share`` taken as the decimal it prints as
    (0.01 x 1600 / 16 is 1 page, not 2 by a rounding error)."""
    return math.ceil(fractions.Fraction(repr(share)) * prompt_tokens / page_size)


def attended_keys(pages: torch.Tensor, context: int, page_size: int, sink_pages: int, recent_pages: int,
                  topk_tokens: int) -> int:
    """Keys one query head attends to when its selection holds the logical ``pages`` of a
    ``context``-token sequence: every valid key of the pages, or with ``topk_tokens`` > 0 those of
    the sink and recent pages plus at most ``topk_tokens`` of the others (ties not counted)."""
    pages = pages.long()
    valid = (context - pages * page_size).clamp(0, page_size)
    if topk_tokens <= 0:
        return int(valid.sum())
    n_pages = -(-context // page_size)
    forced = (pages < sink_pages) | (pages >= n_pages - recent_pages)
    return int(valid[forced].sum()) + min(topk_tokens, int(valid[~forced].sum()))


class TopkSelector:
    """The backend's ``decode_mode=topk`` on one sequence, by the kernels' float64 references."""

    PARAMS: ClassVar[dict[str, type]] = {"sink": int, "recent": int, "budget": int, "share": float,
                                         "tokens": int, "page": int}

    def __init__(self, label: str, *, sink_pages: int = DEFAULT_BUDGET.sink_pages,
                 recent_pages: int = DEFAULT_BUDGET.recent_pages, budget_pages: int = DEFAULT_BUDGET.budget_pages,
                 topk_tokens: int = DEFAULT_BUDGET.topk_tokens, page_size: int = DEFAULT_PAGE_SIZE):
        from vllm_sparse_kernels.reference import topk_decode  # its torch references

        self._ref = topk_decode
        self.label = label
        self.sink_pages, self.recent_pages, self.budget_pages = sink_pages, recent_pages, budget_pages
        self.topk_tokens, self.page_size = topk_tokens, page_size
        self.attended = AttendedShare()
        # per layer: float64 summaries (min, max) [pages, Hkv, D] and the keys they cover
        self._summaries: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        for key, value in params.items():
            if value < 0 or (key == "share" and not 0 < value <= 1):
                raise ValueError(f"{key} must be {'in (0, 1]' if key == 'share' else '>= 0'}, got {value}")
        if "budget" in params and "share" in params:
            raise ValueError("give budget (pages) or share (of the prompt), not both")
        page = params.get("page", DEFAULT_PAGE_SIZE)
        if page < 1 or page & (page - 1):
            raise ValueError(f"page must be a power of two, got {page}")
        budget = 1 if "share" in params else params.get("budget", DEFAULT_BUDGET.budget_pages)  # share: >= 1
        sink, recent = params.get("sink", DEFAULT_BUDGET.sink_pages), params.get("recent", DEFAULT_BUDGET.recent_pages)
        if sink + recent + budget == 0:
            raise ValueError("sink, recent and budget are all 0")

    @classmethod
    def build(cls, label: str, params: dict[str, Any], prompt_tokens: int) -> "TopkSelector":
        page = params.get("page", DEFAULT_PAGE_SIZE)
        budget = (budget_pages_for_share(params["share"], prompt_tokens, page) if "share" in params
                  else params.get("budget", DEFAULT_BUDGET.budget_pages))
        return cls(label, sink_pages=params.get("sink", DEFAULT_BUDGET.sink_pages),
                   recent_pages=params.get("recent", DEFAULT_BUDGET.recent_pages), budget_pages=budget,
                   topk_tokens=params.get("tokens", DEFAULT_BUDGET.topk_tokens), page_size=page)

    def summaries(self, layer: int, key_cache: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's page summaries for a cache of ``length`` keys: pages complete at the
        previous call are kept (their keys never change), the others (re)computed."""
        hkv, d = key_cache.shape[2:]
        empty = torch.empty(0, hkv, d, dtype=torch.float64)
        smin, smax, covered = self._summaries.get(layer, (empty, empty, 0))
        first = covered // self.page_size  # the first page that may have grown since
        new_min, new_max, _ = self._ref.reference_page_summaries(
            key_cache[first:], identity_block_table(key_cache.shape[0] - first),
            torch.tensor([length - first * self.page_size], dtype=torch.int32))
        smin, smax = torch.cat([smin[:first], new_min]), torch.cat([smax[:first], new_max])
        self._summaries[layer] = (smin, smax, length)
        return smin, smax

    def prefill(self, layer, q, k, v) -> None:
        self.summaries(layer, paged_cache(k, self.page_size), k.shape[1])

    def select(self, layer: int, q: torch.Tensor, key_cache: torch.Tensor, length: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(selected logical pages [1, Hkv, width], counts [1, Hkv]) of ``reference_select_pages``."""
        smin, smax = self.summaries(layer, key_cache, length)
        return self._ref.reference_select_pages(
            q[None], smin, smax, identity_block_table(key_cache.shape[0]),
            torch.tensor([length], dtype=torch.int32), self.page_size, sink_pages=self.sink_pages,
            recent_pages=self.recent_pages, num_pages_budget=self.budget_pages)

    def attend(self, layer, q, k, v, scale) -> torch.Tensor:
        length = k.shape[1]
        key_cache, value_cache = paged_cache(k, self.page_size), paged_cache(v, self.page_size)
        selected, counts = self.select(layer, q, key_cache, length)
        out = self._ref.reference_topk_decode_attention(
            q[None], key_cache, value_cache, identity_block_table(key_cache.shape[0]),
            torch.tensor([length], dtype=torch.int32), selected, counts, scale, topk_tokens=self.topk_tokens,
            sink_pages=self.sink_pages, recent_pages=self.recent_pages)
        keys = [attended_keys(selected[0, s, :int(counts[0, s])], length, self.page_size, self.sink_pages,
                              self.recent_pages, self.topk_tokens) for s in range(selected.shape[1])]
        self.attended.add(sum(keys) / len(keys), length)
        return out[0].to(q.dtype)


class SpansSelector:
    """The backend's ``decode_mode=spans`` on one sequence, its prompt prefilled as one chunk: the
    division's loop reference (``span_decode.reference_divide``) on local maps computed here in
    torch (float32: the Triton map kernel is tested against the same float64 definition),
    persistent flags from the last ``last_q`` prompt queries, the fallback key for each page
    decode writes to, and the float64 selection and attention references."""

    PARAMS: ClassVar[dict[str, type]] = {"sink": int, "recent": int, "persist": int, "budget": int,
                                         "share": float, "page": int, "score": str, "index": str,
                                         "persist_by": str, "persist_next": int}
    # the division depends only on the layer's prompt q/k: shared by the variants of one prompt
    _divided: ClassVar[dict[tuple, tuple[torch.Tensor, tuple]]] = {}

    def __init__(self, label: str, *, sink_pages: int, recent_pages: int, persist_pages: int, budget_pages: int,
                 page_size: int = DEFAULT_PAGE_SIZE, score: str = "sum", index: str = "span",
                 persist_by: str = "index", persist_next: int = 0):
        from vllm_sparse_backend.decode.spans import span_params
        from vllm_sparse_kernels.reference import span_decode, topk_decode

        self._spans, self._ref = span_decode, topk_decode
        self.label = label
        self.sink_pages, self.recent_pages = sink_pages, recent_pages
        self.persist_pages, self.budget_pages, self.page_size = persist_pages, budget_pages, page_size
        self.score = score  # "sum": q . (sum of index keys), Eq. 8 as written; "mean": q . their mean
        # the backend's VLLM_SPARSE_DECODE_SPAN_INDEX: "span" (default), every page holds its span's
        # key; "page" (issue 24's probe), every page holds the key of its own most-voted token (the
        # division's votes, InfLLM's representative token at page granularity), decode pages 1 x mean key
        self.index = index
        # "persist_by": how the last prompt queries flag the persistent pages. "index" (the
        # backend's): by the same page scores decode uses (q . span key). "attention" (issue 24 what-if): by their exact attention, the paper's persistent
        # mechanism as it maps onto a cache that stays on the GPU: the last chunk's retrieval is
        # the pages its queries actually attend to (softmax over each query's causal context,
        # summed over the KV head's query heads and the last queries, pooled to pages)
        self.persist_by = persist_by
        # "persist_next": the persistent pages come in runs of 1 + persist_next pages from each of
        # the persist // (1 + persist_next) best-scoring pages on (persistent_runs): the retrieval
        # unit is a short run of pages from the attended one on (the paper retrieves 128-token
        # blocks), so that a value whose tokens cross a page boundary is kept whole
        self.persist_next = persist_next
        self.params = span_params(SparseSettings())
        self.last_q = SparseSettings().patterns.vertical_slash.last_q
        self.attended = AttendedShare()
        self._keys: dict[int, torch.Tensor] = {}  # per layer: float64 span key per page [pages, Hkv, D]
        self._flags: dict[int, torch.Tensor] = {}  # per layer: uint8 [pages, Hkv]

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        TopkSelector.check_params({k: v for k, v in params.items()
                                   if k not in ("persist", "score", "index", "persist_by", "persist_next")})
        if params.get("persist_next", 0) < 0:
            raise ValueError(f"persist_next must be >= 0, got {params['persist_next']}")
        if params.get("persist_next", 0) and params.get("persist_by", "attention") != "attention":
            raise ValueError("persist_next takes persist_by=attention (the backend's decode_persist_next)")
        if params.get("persist_by", "attention") not in ("index", "attention"):
            raise ValueError(f"persist_by must be index or attention, got {params['persist_by']}")
        if params.get("index", "span") not in ("span", "page"):
            raise ValueError(f"index must be span or page, got {params['index']}")
        if params.get("persist", 0) < 0:
            raise ValueError(f"persist must be >= 0, got {params['persist']}")
        if params.get("score", "sum") not in ("sum", "mean"):
            raise ValueError(f"score must be sum or mean, got {params['score']}")

    @classmethod
    def build(cls, label: str, params: dict[str, Any], prompt_tokens: int) -> "SpansSelector":
        cfg = SparseSettings()
        page = params.get("page", DEFAULT_PAGE_SIZE)
        budget = (budget_pages_for_share(params["share"], prompt_tokens, page) if "share" in params
                  else params.get("budget", cfg.decode.budget_pages))
        persist_by = params.get("persist_by", cfg.decode.spans.persist)
        return cls(label, sink_pages=params.get("sink", cfg.decode.sink_pages),
                   recent_pages=params.get("recent", cfg.decode.recent_pages),
                   persist_pages=params.get("persist", cfg.decode.spans.persist_pages), budget_pages=budget, page_size=page,
                   score=params.get("score", "sum"), index=params.get("index", "span"), persist_by=persist_by,
                   persist_next=params.get("persist_next", cfg.decode.spans.persist_next if persist_by == "attention" else 0))

    def local_maps(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Page maps [S, n, n], votes [S, T] and tokens per segment [S] of a prompt divided from
        position 0 (q [H, N, D], k [Hkv, N, D]), as ``span_decode.local_attention_maps`` defines them."""
        h, n_tok, _ = q.shape
        seg, page = self.params.segment_tokens, self.page_size
        n = seg // page
        group = h // k.shape[0]
        maps, votes, lens = [], [], []
        for s0 in range(0, n_tok, seg):
            t = min(seg, n_tok - s0)
            scores = torch.einsum("htd,hsd->hts", q[:, s0:s0 + t].float(),
                                  k[:, s0:s0 + t].float().repeat_interleave(group, 0)) * scale
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            p = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
            padded = torch.zeros(h, seg, seg)
            padded[:, :t, :t] = p
            maps.append(padded.view(h, n, page, n, page).sum((0, 2, 4)))
            votes.append(padded.sum((0, 1)))
            lens.append(t)
        return torch.stack(maps), torch.stack(votes), torch.tensor(lens)

    def divide(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> tuple[list, list, torch.Tensor]:
        """Per segment: the span id of each page and the index tokens (the division's loop
        reference, which the GPU kernels are tested to equal); and the votes of every prompt token."""
        maps, votes, lens = self.local_maps(q, k, scale)
        out = [self._spans.reference_divide(maps[s].double(), votes[s].double(), int(lens[s]), self.page_size,
                                            q.shape[0], self.params) for s in range(lens.shape[0])]
        return [o[0] for o in out], [o[1] for o in out], torch.cat([votes[s, :int(lens[s])] for s in range(len(lens))])

    def prefill(self, layer, q, k, v) -> None:
        scale = q.shape[-1] ** -0.5  # the model's scaling is 1/sqrt(head_dim) (Qwen2, Llama)
        seg, page = self.params.segment_tokens, self.page_size
        n_tok = k.shape[1]
        n_pages = -(-n_tok // page)
        # keyed by the prompt's k tensor, which the entry keeps alive (so its address cannot be
        # reused by another prompt's k while the entry exists)
        cache_key = (layer, k.data_ptr(), n_tok, seg, page)
        if cache_key not in self._divided or self._divided[cache_key][0] is not k:
            self._divided.clear()  # a new prompt
            self._divided[cache_key] = (k, self.divide(q, k, scale))
        spans, index_tokens, votes = self._divided[cache_key][1]
        span_keys = torch.zeros(n_pages, k.shape[0], k.shape[2], dtype=torch.float64)
        keys = k.transpose(0, 1).double()  # [N, Hkv, D]
        for s, (span, chosen) in enumerate(zip(spans, index_tokens) if self.index == "span" else ()):
            p0, t0 = s * seg // page, s * seg
            for sid in set(span):
                tokens = [t0 + t for t in chosen if span[t // page] == sid]
                vector = keys[tokens].sum(0) / (len(tokens) if self.score == "mean" else 1)
                for a, owner in enumerate(span):
                    if owner == sid:
                        span_keys[p0 + a] = vector
        if self.index == "page":  # each page's own most-voted key (ties: the first token)
            for a in range(n_pages):
                span_keys[a] = keys[a * page + int(votes[a * page:(a + 1) * page].double().argmax())]
        # persistent pages: the last last_q prompt queries, summed, per KV head (sink / recent pages excluded)
        q_sum = q[:, -self.last_q:].double().sum(1)  # [H, D]
        group = q.shape[0] // k.shape[0]
        q_last = q_sum.view(k.shape[0], group, -1).sum(1)  # [Hkv, D]: each KV head's query heads summed
        scores = torch.einsum("phd,hd->ph", span_keys, q_last)  # [pages, Hkv]
        if self.persist_by == "attention":
            scores = last_queries_page_mass(q, k, self.last_q, page, scale)
        j = torch.arange(n_pages)
        scores[(j < self.sink_pages) | (j >= n_pages - self.recent_pages)] = float("-inf")
        if self.persist_next:  # persist // (1 + next) anchors, each flagging itself and the next pages
            flags = persistent_runs(scores, self.persist_pages, self.persist_next)
        else:
            flags = torch.zeros(n_pages, k.shape[0], dtype=torch.uint8)
            top_values, top_indices = scores.topk(min(self.persist_pages, n_pages), 0)
            flags.scatter_(0, top_indices, (top_values > float("-inf")).to(torch.uint8))
        self._keys[layer], self._flags[layer] = span_keys, flags

    def attend(self, layer, q, k, v, scale) -> torch.Tensor:
        length = k.shape[1]
        key_cache, value_cache = paged_cache(k, self.page_size), paged_cache(v, self.page_size)
        n_pages = key_cache.shape[0]
        keys, flags = self._keys[layer], self._flags[layer]
        if keys.shape[0] < n_pages:  # a page begun by decode
            keys = torch.cat([keys, torch.zeros(n_pages - keys.shape[0], *keys.shape[1:], dtype=keys.dtype)])
            flags = torch.cat([flags, torch.zeros(n_pages - flags.shape[0], flags.shape[1], dtype=flags.dtype)])
        last = (length - 1) // self.page_size  # the page this step wrote: its fallback key
        fallback = self.params.min_index if self.score == "sum" and self.index == "span" else 1
        keys[last] = fallback * k[:, last * self.page_size:length].double().mean(1)
        self._keys[layer], self._flags[layer] = keys, flags
        table = identity_block_table(n_pages)
        lens = torch.tensor([length], dtype=torch.int32)
        selected, counts = self._spans.reference_select_span_pages(
            q[None], keys, flags, table, lens, self.page_size, sink_pages=self.sink_pages,
            recent_pages=self.recent_pages, persist_pages=self.persist_pages, num_pages_budget=self.budget_pages)
        out = self._ref.reference_topk_decode_attention(q[None], key_cache, value_cache, table, lens, selected,
                                                        counts, scale)
        keys_attended = [attended_keys(selected[0, s, :int(counts[0, s])], length, self.page_size, 0, 0, 0)
                         for s in range(selected.shape[1])]
        self.attended.add(sum(keys_attended) / len(keys_attended), length)
        return out[0].to(q.dtype)


def last_queries_page_mass(q: torch.Tensor, k: torch.Tensor, last_q: int, page: int, scale: float) -> torch.Tensor:
    """float64 [pages, Hkv]: the attention mass each page gets from the prompt's last ``last_q``
    queries (q ``[H, N, D]``, k ``[Hkv, N, D]``): each query's causal softmax, summed over the
    queries and the KV head's query heads, then over the page's keys."""
    h, n, _ = q.shape
    hkv = k.shape[0]
    n_last = min(last_q, n)
    qs = q[:, n - n_last:].double()  # [H, n_last, D]
    kk = k.double().repeat_interleave(h // hkv, 0)  # [H, N, D]
    logits = torch.einsum("hqd,hkd->hqk", qs, kk) * scale
    pos = torch.arange(n - n_last, n)[:, None]
    logits = logits.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
    mass = logits.softmax(-1).sum(1).view(hkv, h // hkv, n).sum(1)  # [Hkv, N]
    n_pages = -(-n // page)
    mass = torch.nn.functional.pad(mass, (0, n_pages * page - n))
    return mass.view(hkv, n_pages, page).sum(-1).t().contiguous()


def persistent_runs(scores: torch.Tensor, persist: int, next_pages: int) -> torch.Tensor:
    """uint8 flags [pages, Hkv]: per KV head, the ``persist // (1 + next_pages)`` best pages of
    ``scores`` [pages, Hkv] (-inf: never; ties to the lower page) and the ``next_pages`` pages after
    each, where those may be flagged (finite score). Runs that overlap flag fewer pages."""
    n_pages, hkv = scores.shape
    anchors = min(persist // (1 + next_pages), n_pages)
    order = scores.sort(dim=0, descending=True, stable=True)
    flags = torch.zeros(n_pages, hkv, dtype=torch.uint8)
    for g in range(hkv):
        for value, j in zip(order.values[:anchors, g].tolist(), order.indices[:anchors, g].tolist()):
            if value == float("-inf"):
                break
            for p in range(j, min(j + 1 + next_pages, n_pages)):
                if scores[p, g] > float("-inf"):
                    flags[p, g] = 1
    return flags


SELECTORS: dict[str, type] = {"dense": DenseSelector, "topk": TopkSelector, "spans": SpansSelector}


# ---------------------------------------------------------------------------------------------
# Variant specs
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VariantSpec:
    label: str  # the spec as given
    kind: str  # a key of SELECTORS
    params: dict[str, Any]


def parse_variant(spec: str, selectors: dict[str, type] = SELECTORS) -> VariantSpec:
    """``NAME`` or ``NAME:KEY=VALUE[,KEY=VALUE...]`` -> VariantSpec; ValueError naming the spec
    and the problem (unknown name or key, malformed item, repeated key, bad value)."""
    kind, colon, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in selectors:
        raise ValueError(f"variant {spec!r}: unknown selector {kind!r} (known: {', '.join(selectors)})")
    accepted = selectors[kind].PARAMS
    if colon and not rest.strip():
        raise ValueError(f"variant {spec!r}: nothing after ':' (give KEY=VALUE pairs or no ':')")
    params: dict[str, Any] = {}
    for item in rest.split(",") if colon else []:
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key or not value:
            raise ValueError(f"variant {spec!r}: {item.strip()!r} is not KEY=VALUE")
        if key not in accepted:
            known = ", ".join(accepted) or "none"
            raise ValueError(f"variant {spec!r}: {kind} has no parameter {key!r} (known: {known})")
        if key in params:
            raise ValueError(f"variant {spec!r}: {key} given twice")
        try:
            params[key] = accepted[key](value)
        except ValueError:
            kind_of = "an integer" if accepted[key] is int else "a number"
            raise ValueError(f"variant {spec!r}: {key} must be {kind_of}, got {value!r}") from None
    try:
        selectors[kind].check_params(params)
    except ValueError as e:
        raise ValueError(f"variant {spec!r}: {e}") from None
    return VariantSpec(spec, kind, params)


def build_selector(variant: VariantSpec, prompt_tokens: int) -> DecodeSelector:
    return SELECTORS[variant.kind].build(variant.label, variant.params, prompt_tokens)


# ---------------------------------------------------------------------------------------------
# The model run
# ---------------------------------------------------------------------------------------------

class SelectorAttention:
    """Attention function for transformers. Prefill (more than one query): SDPA, and the prompt's
    q/k/v handed to every selector in ``prefill_selectors``. Decode: the output of ``selector``,
    compared with exact attention over the same cache (``errors``)."""

    def __init__(self) -> None:
        self.prefill_selectors: list[DecodeSelector] = []
        self.selector: DecodeSelector | None = None
        self.errors: list[float] = []  # relative error vs exact attention, per decode call
        self.prefill_check = 0.0  # max relative difference of the recomputed last prompt row
        self.dense_check: dict[int, float] = {}  # per layer: max relative difference of the dense selector from SDPA

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if query.shape[0] != 1:
            raise RuntimeError(f"one sequence at a time, got a batch of {query.shape[0]}")
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        layer = module.layer_idx
        q, k, v = query[0].detach().float(), key[0].detach().float(), value[0].detach().float()
        if query.shape[2] > 1:
            out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                                  **kwargs)
            last = exact_attention(q[:, -1], k, v, scale)  # the prompt's last row sees every key
            self.prefill_check = max(self.prefill_check, relative_error(out[0, -1], last))
            for s in self.prefill_selectors:
                s.prefill(layer, q, k, v)
            return out, weights
        mine = self.selector.attend(layer, q[:, 0], k, v, scale)
        exact = exact_attention(q[:, 0], k, v, scale)
        self.errors.append(relative_error(mine, exact))
        if isinstance(self.selector, DenseSelector):
            sdpa, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
            diff = relative_error(mine, sdpa[0, 0])
            self.dense_check[layer] = max(self.dense_check.get(layer, 0.0), diff)
            if diff > DENSE_ABORT_RTOL:
                raise RuntimeError(f"layer {layer}: dense selector differs from SDPA by {diff:.2e} (relative)")
        return mine.to(query.dtype)[None, None], None


def stop_token_ids(model_dir: str | pathlib.Path, tokenizer) -> list[int]:
    """The ids vLLM stops at: the generation config's eos_token_id(s) and the tokenizer's."""
    from transformers import GenerationConfig

    ids = set()
    try:
        eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
        ids.update([eos] if isinstance(eos, int) else eos or [])
    except OSError:  # no generation_config.json
        pass
    if isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def greedy_decode(model, cache, first_token: int, max_tokens: int, stop_ids: Sequence[int]) -> list[int]:
    """Greedy tokens from ``cache`` (which it extends) after ``first_token``, ``first_token``
    included, up to ``max_tokens`` in all or a stop token (kept at the end)."""
    tokens = [first_token]
    while len(tokens) < max_tokens and tokens[-1] not in stop_ids:
        res = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = res.past_key_values
        tokens.append(int(res.logits[0, -1].argmax()))
    return tokens


@dataclass
class DecodeResult(acc.Result):
    """The harness's result record; ``density`` holds the mean attended share of the context per
    decode call, ``ttft_s`` the shared prefill (which gives the first token), ``total_s`` that
    plus this variant's decode."""

    budget_pages: int | None = None
    generated_tokens: int = 0
    decode_s: float = 0.0
    output_error_mean: float | None = None
    output_error_max: float | None = None


def run_prompt(model, attention: SelectorAttention, sample, variants: Sequence[VariantSpec],
               stop_ids: Sequence[int], decode_text, log=print) -> list[DecodeResult]:
    """One dense prefill of ``sample``, then every variant's greedy decode from a copy of its cache."""
    selectors = [build_selector(v, sample.n_tokens) for v in variants]
    attention.prefill_selectors = selectors
    with torch.no_grad():
        t0 = time.monotonic()
        res = model(torch.tensor([sample.prompt_ids]), use_cache=True, logits_to_keep=1)
        prefill_s = time.monotonic() - t0
        attention.prefill_selectors = []
        if attention.prefill_check > PREFILL_CHECK_RTOL:
            raise RuntimeError(f"the q/k/v given to prefill() do not reproduce SDPA's last row "
                               f"({attention.prefill_check:.2e} relative)")
        first = int(res.logits[0, -1].argmax())
        log(f"{sample.key} ({sample.n_tokens} tokens, depth {sample.depth}): prefill {prefill_s:.1f} s", flush=True)
        results = []
        for v, sel in zip(variants, selectors):
            attention.selector, attention.errors = sel, []
            t0 = time.monotonic()
            tokens = greedy_decode(model, copy.deepcopy(res.past_key_values), first, sample.max_tokens, stop_ids)
            decode_s = time.monotonic() - t0
            text = decode_text([t for t in tokens if t not in stop_ids])
            errors = attention.errors
            r = DecodeResult(v.label, sample.task, sample.target_tokens, sample.n_tokens, sample.seed,
                             sample.depth, list(sample.expected), text, score(sample, text),
                             round(prefill_s, 3), round(prefill_s + decode_s, 3), density=sel.attended.mean,
                             budget_pages=getattr(sel, "budget_pages", None), generated_tokens=len(tokens),
                             decode_s=round(decode_s, 3),
                             output_error_mean=statistics.fmean(errors) if errors else None,
                             output_error_max=max(errors) if errors else None)
            results.append(r)
            share = "-" if r.density is None else f"{r.density:.4f}"
            log(f"  [{v.label}] score {r.score:.2f}, attended {share}, out err {r.output_error_mean or 0:.2e}, "
                f"{len(tokens)} tokens in {decode_s:.1f} s; {text.strip()[:70]!r}", flush=True)
        attention.selector = None
    return results


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def format_table(rows: Sequence[dict], labels: Sequence[str]) -> str:
    """Per task and length, per variant: mean score, attended share, share of outputs equal to
    the first variant's."""
    f = acc.fmt
    width = 20
    head = f"{'task':<18} {'tokens':>6} {'n':>2}" + "".join(f" | {label[:width]:^{width}}" for label in labels)
    sub = f"{'':<18} {'':>6} {'':>2}" + "".join(f" | {'acc':>5} {'attend':>7} {'same':>5}" for _ in labels)
    lines = [head, sub, "-" * len(sub)]
    for row in rows:
        n = next((row[label]["n"] for label in labels if label in row), 0)
        line = f"{row['task']:<18} {row['tokens']:>6} {n:>2}"
        for label in labels:
            c = row.get(label)
            line += (f" | {'':>{width}}" if c is None else
                     f" | {f(c['accuracy'], '.2f'):>5} {f(c['density'], '.4f'):>7} {f(c['same_output'], '.2f'):>5}")
        lines.append(line)
    return "\n".join(lines)


def relative_to(summary: dict[str, dict], base: str) -> dict[str, float | None]:
    """Each variant's overall score divided by ``base``'s (None where that is 0 or absent)."""
    ref = summary.get(base, {}).get("accuracy")
    return {label: (s["accuracy"] / ref if ref else None) for label, s in summary.items()}


def main(argv: list[str] | None = None) -> int:
    from vllm_sparse_tools.evaluation import inputs
    from vllm_sparse_tools.evaluation.tasks import TASKS, HFTokenizer, make_samples

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen-coder", help=f"{', '.join(inputs.MODELS)}, or a model folder")
    p.add_argument("--text", default="austen", help=f"{', '.join(inputs.TEXTS)}, or a text file")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--lengths", nargs="+", type=int, default=[8192], help="prompt lengths in tokens")
    p.add_argument("--samples", type=int, default=2, help="prompts per task and length")
    p.add_argument("--seed", type=int, default=0, help="first sample's seed")
    p.add_argument("--variants", nargs="+", default=["dense", "topk:share=0.01", "topk:budget=64"],
                   help="NAME[:KEY=VALUE,...] with NAME in " + ", ".join(SELECTORS) + " (see the module docstring)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--out", help="output path without extension")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.monotonic()

    try:
        variants = [parse_variant(s) for s in args.variants]
        if len({v.label for v in variants}) != len(variants):
            raise ValueError(f"variant labels must be unique: {args.variants}")
        model_dir, model_name = inputs.resolve_model(args.model)
        text, text_name = inputs.resolve_text(args.text)
    except ValueError as e:
        p.error(str(e))
    labels = [v.label for v in variants]
    short = inputs.short_model_name(args.model, model_name)
    tok = HFTokenizer(str(model_dir))
    samples = make_samples(tok, text, args.tasks, args.lengths, args.samples, args.seed)
    context = acc.model_config(model_dir).get("max_position_embeddings")
    longest = max(s.n_tokens + s.max_tokens for s in samples)
    if context and longest > context:
        p.error(f"prompts need {longest} tokens; the model's context is {context}")
    stop_ids = stop_token_ids(model_dir, tok.tok)
    print(f"model {model_name}, text {text_name}: {len(samples)} prompts, variants {' '.join(labels)}, "
          f"stop ids {stop_ids}, {torch.get_num_threads()} threads", flush=True)

    date = datetime.date.today().isoformat()
    lengths = "-".join(f"{round(n / 1000)}k" for n in args.lengths)
    out_json, out_txt = inputs.result_paths(args.out, REPO / "benchmarks" / "results" /
                                            f"decode_accuracy_cpu_{short}_{lengths}_{date}")

    import transformers
    from transformers import AttentionInterface, AutoModelForCausalLM

    attention = SelectorAttention()
    AttentionInterface.register(_ATTENTION_NAME, attention)
    t0 = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation=_ATTENTION_NAME,
                                                 dtype=torch.float32)
    model.eval()
    timings: dict[str, Any] = {"load_s": time.monotonic() - t0}
    meta = {"model": model_name, "model_dir": model_dir.name, "text": text_name, "device": "cpu",
            "dtype": "float32", "threads": torch.get_num_threads(), "host": platform.node(), "date": date,
            "tasks": args.tasks, "lengths": args.lengths, "samples": args.samples, "seed": args.seed,
            "variants": {v.label: {"selector": v.kind, **v.params} for v in variants},
            "topk_defaults": {"sink": DEFAULT_BUDGET.sink_pages, "recent": DEFAULT_BUDGET.recent_pages,
                              "budget": DEFAULT_BUDGET.budget_pages, "tokens": DEFAULT_BUDGET.topk_tokens,
                              "page": DEFAULT_PAGE_SIZE},
            "stop_token_ids": stop_ids, "dense_check_rtol": DENSE_CHECK_RTOL,
            "fields": "density = mean over decode calls (layers x steps) of keys attended per query head / "
                      "context length; ttft_s = the shared dense prefill; total_s = prefill + this "
                      "variant's decode; output_error_* = relative L2 error of the decode attention "
                      "output vs exact attention over the same cache, per call",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "command": " ".join(sys.argv), "timings_s": timings}
    results: list[DecodeResult] = []

    def save() -> list[str]:
        rows = acc.summarize(results, labels)
        summary = acc.overall(results, labels)
        relative = relative_to(summary, "dense")
        decode = {label: sum(r.decode_s for r in results if r.variant == label) for label in labels}
        tokens = {label: sum(r.generated_tokens for r in results if r.variant == label) for label in labels}
        prefill = sum(r.ttft_s for r in results if r.variant == labels[0])
        timings.update(prefill_s=prefill, decode_s=decode, total_s=time.monotonic() - t_start)
        n_done = len({(r.task, r.target_tokens, r.seed) for r in results})
        lines = [f"# {model_name} in transformers on cpu (fp32, {torch.get_num_threads()} threads), {date}: "
                 f"{n_done} prompt(s), {args.samples} per task and length, text {text_name}; one dense "
                 "prefill per prompt, then each variant decodes greedily from a copy of its cache",
                 "# acc = mean score; attend = mean share of the context attended per decode call (keys per "
                 "query head / context, sink and recent pages included); same = share of outputs equal "
                 f"to {labels[0]}'s",
                 "# topk defaults: sink 1 page, recent 8 pages, page 16 tokens, every key of the chosen "
                 "pages (tokens=0); share=s: budget = ceil(s x prompt tokens / page) pages",
                 format_table(rows, labels), "",
                 f"overall ({next(iter(summary.values()))['n'] if summary else 0} prompts run by every "
                 "variant):"]
        for label, s in summary.items():
            rel = relative.get(label)
            errs = [r.output_error_mean for r in results if r.variant == label and r.output_error_mean is not None]
            lines.append(f"  {label:<24} acc {s['accuracy']:.3f}  attend {s['density']:.4f}"
                         + (f"  vs dense {rel:.3f}" if rel is not None else "")
                         + (f"  out err {statistics.fmean(errs):.2e}" if errs else "")
                         + f"  decode {decode[label]:.0f} s / {tokens[label]} tokens")
        worst_layer, worst = max(attention.dense_check.items(), key=lambda kv: kv[1], default=(None, 0.0))
        lines.append(f"# checks: dense selector vs SDPA, max relative difference {worst:.1e} (layer {worst_layer}; "
                     f"limit {DENSE_CHECK_RTOL:.0e}); its error vs float64 exact attention is the dense row's "
                     f"out err; last prompt row from the q/k/v given to prefill() vs SDPA "
                     f"{attention.prefill_check:.1e}")
        lines.append(f"# timings: load {timings['load_s']:.0f} s, prefill {prefill:.0f} s (shared), "
                     f"total {timings['total_s']:.0f} s; torch {torch.__version__}, transformers "
                     f"{transformers.__version__}")
        meta.update(dense_vs_sdpa_max_per_layer=attention.dense_check, prefill_row_check_max=attention.prefill_check)
        out_json.write_text(json.dumps(
            {"meta": meta, "rows": rows, "overall": summary, "relative_to_dense": relative,
             "results": [asdict(r) for r in results]}, indent=1) + "\n")
        out_txt.write_text("\n".join(lines) + "\n")
        return lines

    for sample in samples:
        results += run_prompt(model, attention, sample, variants, stop_ids,
                              lambda ids: tok.tok.decode(ids, skip_special_tokens=True))
        save()
    lines = save()
    print("\n".join(lines))
    print(f"wrote {out_json} and {out_txt}")
    worst = max(attention.dense_check.values(), default=0.0)
    if worst > DENSE_CHECK_RTOL:
        print(f"CHECK FAILED: the dense selector differs from SDPA by up to {worst:.1e} (relative), more than "
              f"{DENSE_CHECK_RTOL:.0e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
