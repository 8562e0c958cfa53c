"""The pattern interface, and the pieces the pattern estimators share.

A pattern is one class in its own file of this folder, registered by one line in
:data:`vllm_sparse_backend.prefill.patterns.PATTERNS`. It says everything the rest of the
backend needs to know about it:

* its per-head parameters (:attr:`Pattern.head_params`, a pydantic model): what a head-config
  entry of the pattern may set, with their bounds; a resolved head carries exactly these. A
  parameter that a setting of the pattern also sets is made from that setting by
  :func:`per_head_params`, so that its bounds are written once;
* its settings (:attr:`Pattern.settings_model`, a :class:`~vllm_sparse_backend.config.PatternGroup`
  declared in the pattern's file, or None): the group ``settings.patterns.<name>``, which
  :mod:`vllm_sparse_backend.settings` builds from the registry;
* what its budgets allow before anything is estimated (:meth:`Pattern.keys_per_query`,
  :meth:`Pattern.covers_every_key`: the planner and the density gate use them);
* whether the heads of a KV group may share one selection (:attr:`Pattern.group_shareable`);
* its two estimators: :meth:`Pattern.select` in PyTorch on a row's gathered K (the CPU path and
  ``kernel=torch``), :meth:`Pattern.estimate_paged` on the GPU straight from the paged cache.
* optionally, how the offline search scales it (:attr:`Pattern.search`, a :class:`SearchKnob`):
  a pattern that declares one is a candidate of ``vllm_sparse_tools.search``.

Nothing outside this folder dispatches on a pattern's name. The score arithmetic the estimators
share with the GPU kernels (``block_means``, ``sum_head_groups``, ``cumulative_budget``) lives in
:mod:`vllm_sparse_kernels.prefill.estimate_math` and is re-exported here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, create_model
from vllm_sparse_kernels.prefill.estimate_math import (LAST_QUERIES_PER_CALL, block_means, cumulative_budget,  # noqa: F401
                                                        sampled_softmax, sum_head_groups)

from ...config import PatternGroup
from ..index import SparseIndex, build_index

if TYPE_CHECKING:
    from ...head_configs import ResolvedHead
    from ...settings import SparseSettings


class HeadParams(BaseModel):
    """A pattern's per-head parameters, as a head-config entry of the pattern sets them. A
    subclass (usually made by :func:`per_head_params`) has one field per parameter, with its
    bounds and ``None`` as the default: a head that leaves a parameter out takes its pattern's
    setting of the same name (``settings.patterns.<pattern name>.<parameter>``); a parameter its
    pattern's settings lack is declared by hand and gives its own default instead. Fields nobody
    declares are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def per_head_params(settings_model: type[PatternGroup], *names: str) -> type[HeadParams]:
    """The :class:`HeadParams` model whose fields are the settings ``names`` of ``settings_model``,
    each optional (None: the head takes the setting) with the setting's type, bounds and
    description. The bounds live on the setting alone: a head-config entry is then held to the
    same limits as the value it overrides, and changing one changes both."""
    fields = {}
    for name in names:
        setting = settings_model.model_fields.get(name)
        if setting is None:
            raise TypeError(f"per_head_params: {settings_model.__name__} has no setting {name!r} "
                            f"(its settings: {', '.join(settings_model.model_fields)})")
        # the bounds are the field's metadata (Ge, Le, ...); its other extras (the flat
        # environment name) belong to the setting, not to a head-config entry
        fields[name] = (Annotated[(setting.annotation | None, *setting.metadata)],
                        Field(None, description=setting.description))
    return create_model(settings_model.__name__.removesuffix("Settings") + "Params", __base__=HeadParams,
                        __module__=settings_model.__module__, **fields)


@dataclass(frozen=True)
class SearchKnob:
    """How the offline pattern search (``vllm_sparse_tools.search``) tunes a pattern: one scalar
    knob, raised until the selection reaches the search's kernel-cost budget, sets the head
    parameter ``param``; with ``ratios``, one candidate per ratio whose ``ratio_param`` is
    ``round(ratio * knob)``; ``fixed`` head parameters keep the values given. Ties in the search's
    error go to the pattern with the lowest ``serving_cost`` (its estimation's cost when served)."""

    label: str  # the short name of its candidates in the search's log ("vs" -> vs8, vs1, ...)
    param: str
    serving_cost: int
    ratio_param: str | None = None
    ratios: tuple[float, ...] = ()
    fixed: tuple[tuple[str, int | float], ...] = ()

    def families(self, pattern: str) -> tuple[tuple[str, float | None], ...]:
        """The search's candidate families of ``pattern``: (name, ratio), ratio None without ratios."""
        return tuple((pattern, r) for r in self.ratios) if self.ratio_param else ((pattern, None),)

    def head_params(self, knob: int, ratio: float | None = None) -> dict[str, int | float]:
        """The head parameters at ``knob`` (each budget at least 1)."""
        params = {**dict(self.fixed), self.param: max(1, knob)}
        if self.ratio_param:
            params[self.ratio_param] = max(1, round(ratio * knob))
        return params


@dataclass
class HeadGroup:
    """The heads (or, with a shared selection, the KV groups) of one layer that have one pattern,
    with their budgets on the device: what a pattern's GPU estimator is handed."""

    pattern: "Pattern"
    ids: torch.Tensor  # int64 [n] lists of the layer with this pattern (query heads, or KV heads when shared)
    params: dict[str, torch.Tensor]  # per-list budgets [n], one entry per field of Pattern.head_params
    max_params: dict[str, float]  # the largest of each, as host numbers (output widths)
    min_params: dict[str, float]  # the smallest (equal to the largest: one budget for the group)
    all_heads: bool  # the group is the whole layer (no head selection or scatter needed)


@dataclass
class HeadSplit:
    """Heads of one pattern whose stats label was decided on the device (FlexPrefill: query-aware
    or vertical-slash per head): ``count`` of them (an int64 scalar tensor) are ``label``, the
    rest ``rest``. Read back later, without a host sync."""

    pattern: str
    label: str
    rest: str
    count: torch.Tensor


@dataclass
class PagedSelection:
    """A GPU estimator's result: the index of its group's lists, and the split of the group's
    heads into stats labels where that was decided on the device."""

    index: SparseIndex
    split: HeadSplit | None = None


class Pattern(ABC):
    """One prefill pattern. Subclasses set :attr:`name` and implement the four methods."""

    name: ClassVar[str]
    # The per-head parameters (each becomes a [heads] tensor for the estimators; nothing else of
    # a head reaches them). The base class: none.
    head_params: ClassVar[type[HeadParams]] = HeadParams
    # The pattern's settings, ``settings.patterns.<name>`` (flat names as environment variables
    # too): budgets the user sets for all its heads, the defaults of its head parameters of the
    # same name. None: the pattern has no settings.
    settings_model: ClassVar[type[PatternGroup] | None] = None
    # Whether the query heads of a KV group may share one key selection (kv_group_shared). A
    # pattern whose per-head decision has no group form says False.
    group_shareable: ClassVar[bool] = True
    # How the offline search tunes it; None: the search does not offer it.
    search: ClassVar[SearchKnob | None] = None

    @property
    def head_fields(self) -> tuple[str, ...]:
        """The names of :attr:`head_params`' fields, in their order."""
        return tuple(self.head_params.model_fields)

    @abstractmethod
    def keys_per_query(self, head: ResolvedHead, kv_len: int, visible: float, settings: SparseSettings) -> float:
        """Keys one query of a row of ``kv_len`` keys selects at most by the budgets alone, were
        the selection as compact as the budgets say (``visible``: the mean number of keys a
        query of the row can see; return it for "every key")."""

    @abstractmethod
    def covers_every_key(self, head: ResolvedHead, kv_len: int, settings: SparseSettings) -> bool:
        """True when the budgets alone select every key of a row of ``kv_len`` keys, whatever
        the scores (the row then computes dense attention)."""

    @abstractmethod
    def select(self, q: torch.Tensor, k: torch.Tensor, kvh: torch.Tensor, ctx_len: int,
               params: dict[str, torch.Tensor], settings: SparseSettings, scale: float,
               share: int) -> tuple["PatternSelection", dict[str, int]]:
        """PyTorch estimator. q: [q_len, h, D] (this pattern's heads), k: [kv_len, Hkv, D] (all
        keys of the row), kvh: [h] the KV head of each head; ``params``: per-head budgets
        (one per field of :attr:`head_params`). Returns the selection and the heads per pattern label for the
        stats (normally ``{name: h}``)."""

    @abstractmethod
    def estimate_paged(self, q_row: torch.Tensor, key_cache: torch.Tensor, block_table_row: torch.Tensor,
                       ctx_len: int, group: HeadGroup, num_lists: int, settings: SparseSettings, scale: float,
                       share: int, k_scale=None) -> PagedSelection:
        """GPU estimator on the paged cache, with no host sync. q_row: [q_len, H, D] every head of
        the layer; returns the index of the group's lists (``group.ids`` of the layer's
        ``num_lists`` lists), or of all lists where the estimator computes them anyway."""



@dataclass
class PatternSelection:
    """What an estimator selects for a subset of heads, before assembly into a SparseIndex.

    block_mask: bool [h, NQB, NKB]; columns: int64 [h, C] absolute key positions with
    column_keep: bool [h, C] (False = padding). C may be 0. range_count / range_start: key
    ranges per query block (``SparseIndex``'s format), or None.
    """

    block_mask: torch.Tensor
    columns: torch.Tensor
    column_keep: torch.Tensor
    range_count: torch.Tensor | None = None
    range_start: torch.Tensor | None = None

    @staticmethod
    def blocks_only(block_mask: torch.Tensor) -> "PatternSelection":
        h = block_mask.shape[0]
        empty = torch.zeros(h, 0, dtype=torch.int64, device=block_mask.device)
        return PatternSelection(block_mask, empty, empty.bool())

    def to_index(self, block_size: int, q_len: int, ctx_len: int) -> SparseIndex:
        """This selection alone as a SparseIndex (``index.build_index``)."""
        return build_index(self.block_mask, block_size, q_len, ctx_len, self.columns, self.column_keep,
                           self.range_count, self.range_start)

    def repeat_heads(self, n: int) -> "PatternSelection":
        """Each selection used by ``n`` consecutive heads (a KV group's shared selection)."""
        if n == 1:
            return self
        return PatternSelection(*(None if t is None else t.repeat_interleave(n, dim=0) for t in (
            self.block_mask, self.columns, self.column_keep, self.range_count, self.range_start)))


def last_queries_probs(q: torch.Tensor, k: torch.Tensor, kvh: torch.Tensor, ctx_len: int, n: int,
                       scale: float, normalizer_sample: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax of the last ``n`` queries of the chunk against all keys (fp32); with
    ``normalizer_sample`` > 1 normalised as the GPU estimator's sampled pass 1 does
    (:func:`~vllm_sparse_kernels.prefill.estimate_math.sampled_softmax`, for each 64 queries
    as it takes them: ending at the chunk's end, then 64 earlier, ...).

    Returns (probs [h, n', kv_len], absolute positions of those queries [n']).
    """
    q_len = q.shape[0]
    kv_len = k.shape[0]
    n = min(n, q_len)
    qs = q[q_len - n:].transpose(0, 1).float()  # [h, n, D]
    ks = k.transpose(0, 1).float()[kvh]  # [h, kv_len, D]; estimation-sized gather only
    s = torch.matmul(qs, ks.transpose(-1, -2)) * scale
    qpos = torch.arange(q_len - n, q_len, device=q.device) + ctx_len
    key_pos = torch.arange(kv_len, device=q.device)
    s = s.masked_fill(key_pos[None, :] > qpos[:, None], float("-inf"))
    if normalizer_sample == 1:
        return torch.softmax(s, dim=-1), qpos
    probs = torch.empty_like(s)
    for end in range(n, 0, -LAST_QUERIES_PER_CALL):  # the estimator's calls: 64 queries each, from the end
        rows = slice(max(end - LAST_QUERIES_PER_CALL, 0), end)
        probs[:, rows] = sampled_softmax(s[:, rows], key_pos, int(qpos[rows.start]), normalizer_sample)
    return probs, qpos


def vertical_and_slash_sums(probs: torch.Tensor, qpos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column sums [h, kv_len] and diagonal sums [h, kv_len] (index d = query pos - key pos)."""
    h, n, kv_len = probs.shape
    vertical = probs.sum(1)
    d = qpos[:, None] - torch.arange(kv_len, device=probs.device)[None, :]  # [n, kv_len]
    d = d.clamp(min=0)  # masked (future) keys have probability 0, so where they land is irrelevant
    slash = torch.zeros(h, kv_len, dtype=probs.dtype, device=probs.device)
    slash.scatter_add_(1, d.reshape(1, -1).expand(h, -1), probs.reshape(h, -1))
    return vertical, slash


def keep_top(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """bool mask of the ``counts[h]`` highest entries of each row of scores [h, N]."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order))
    return ranks < counts.to(scores.device)[:, None]


