"""What a step's plan is made of: its rows (:class:`SparseRow`), the plan (:class:`StepPlan`, made
by :func:`.route.plan_step`), each layer's heads on this rank (:class:`RankHeads`), and what a
layer's sparse call did (:class:`LayerOutcome`, returned by :mod:`.run`).

Pure Python over CPU-side lengths, so the builders can use it without a device sync and tests
without vLLM.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from .budgets import kv_group_share
from ..config import ConfigError
from ..settings import SparseSettings
from ..head_configs import HeadConfigFile, ResolvedHead, layer_heads


@dataclass(frozen=True)
class SparseRow:
    """One request's chunk: queries at absolute positions ctx_len .. ctx_len + q_len - 1."""

    row: int  # index of the request in the batch
    tok_start: int  # first token of the chunk in the step's flattened query/output tensors
    q_len: int
    ctx_len: int
    # the chunk's last queries computed over every key after the sparse path (the router's
    # gating.exact_last_rows / exact_prompt_end): the rows an answer starts from
    exact_rows: int = 0


@dataclass
class LayerOutcome:
    """Rows left to the dense kernel and why; rows computed sparse with their estimates (device
    tensors on the paged path); ``flags``: per such row, ran in the kernel's dense mode (device)."""

    num_heads: int
    paged: bool
    dense: list[tuple[SparseRow, str]] = field(default_factory=list)
    sparse: list[tuple[SparseRow, Any]] = field(default_factory=list)
    every_key: set[int] = field(default_factory=set)  # rows run sparse with every key: counted dense
    flags: Any = None  # bool tensor on the device, or None

    @property
    def dense_rows(self) -> list[SparseRow]:
        return [row for row, _ in self.dense]


@dataclass
class StepPlan:
    sparse_rows: list[SparseRow]
    dense_runs: list[tuple[int, int]]  # maximal runs [first_row, end_row) of rows for the dense kernel
    dense_reasons: Counter = field(default_factory=Counter)  # why long rows stayed dense

    @property
    def has_sparse(self) -> bool:
        return bool(self.sparse_rows)


def tp_local_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) of one tensor-parallel rank, by vLLM's column-parallel QKV layout
    (``QKVParallelLinear``): rank r holds query heads r*H/tp .. (r+1)*H/tp - 1 and, when
    Hkv >= tp, KV heads r*Hkv/tp .. (r+1)*Hkv/tp - 1; when Hkv < tp each rank holds one KV head,
    number r // (tp / Hkv) (each replicated on tp / Hkv ranks). Either way a rank's query heads
    and its KV heads keep the model's GQA mapping."""
    if tp_size < 1 or num_heads % tp_size or num_heads % num_kv_heads \
            or (num_kv_heads % tp_size and tp_size % num_kv_heads):
        raise ConfigError(f"tensor parallel size {tp_size} does not fit {num_heads} query / {num_kv_heads} KV heads "
                          "(vLLM needs it to divide the query heads, and to divide or be a multiple of the KV heads)")
    return num_heads // tp_size, max(1, num_kv_heads // tp_size)


@dataclass(frozen=True)
class RankHeads:
    """One attention layer's query heads on one tensor-parallel rank (all of them at TP=1): their
    patterns, in vLLM's head order, and ``share``, the query heads per shared key selection on
    this rank (:func:`..budgets.kv_group_share`, decided for the whole layer: see :func:`rank_heads`)."""

    heads: list[ResolvedHead]
    share: int = 1


def rank_heads(cfg: HeadConfigFile | None, settings: SparseSettings, layer_index: int, num_heads: int,
               num_kv_heads: int, tp_size: int = 1, tp_rank: int = 0) -> RankHeads:
    """The part of one layer that rank ``tp_rank`` of ``tp_size`` computes. ``num_heads`` /
    ``num_kv_heads``: the model's (all ranks'); the head-config file ``cfg`` names global heads
    and the rank takes its slice (:func:`tp_local_heads`).

    Whether KV groups share one selection is decided on the whole layer, as at TP=1: a layer with
    one mixed group somewhere keeps one selection per query head on every rank, so that a rank
    whose own groups happen to be uniform does not select differently from the single-GPU run.
    Where a rank holds part of a KV group (Hkv < tp), its shared selection is made from the scores
    of the heads it holds: every rank computes its heads on its own, so that part of the group is
    the unit (its selection can differ from TP=1's, which sums the whole group's scores)."""
    local_heads, local_kv = tp_local_heads(num_heads, num_kv_heads, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tensor parallel rank {tp_rank} is not in 0..{tp_size - 1}")
    heads = layer_heads(cfg, settings, layer_index, local_heads, tp_rank)
    whole_layer = layer_heads(cfg, settings, layer_index, num_heads) if tp_size > 1 else heads
    share = kv_group_share(heads, local_kv, settings) if kv_group_share(whole_layer, num_kv_heads, settings) > 1 else 1
    return RankHeads(heads, share)
