"""Whether a row's sparse path can beat FlashAttention, decided on the host before the row is
estimated (``cost_model``), and what a layer has measured about its own selections.

Costs are in units of one FlashAttention pair: the time FlashAttention takes for one causal
(query, key) pair of one head at head size 128. A row's dense cost is its causal pairs; its
sparse cost is

* the estimation: ``last_q`` query rows scored against every key, per head (memory-bound passes
  over K, several pairs' worth each);
* a fixed cost per row and layer: the estimation's and the index conversion's launches and host
  work, which do not shrink with the row (scaled by 128 / head size, since a pair of a smaller
  head is cheaper while the launches are not);
* the pairs the kernel computes, each a little dearer than FlashAttention's (column gathers,
  tile lists instead of a dense sweep): ``predicted density x causal pairs``.

The predicted density is the row's budget density (:func:`.budgets.budget_density`) times the
layer's measured expansion (:class:`LayerDensityHistory`): what its last estimated rows really
computed per pair their budgets allowed. Scattered diagonals each cost whole key blocks, so on real
models the computed density is several times the budget density, and only measuring tells by how
much. The constants come from profiles of Qwen2.5-Coder-1.5B on an H200 (docs/cost-model.md); a
wrong guess costs speed, never accuracy: a row sent dense computes exact attention, a row
estimated that comes out too dense still goes to FlashAttention (``max_density``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm_sparse_kernels.index_format import causal_pairs


@dataclass(frozen=True)
class RowCost:
    sparse_pair: float = 1.1  # one pair computed by the sparse kernel
    estimate_key: float = 7.0  # one (last-q query, key) score of the estimation, per head
    row_overhead: float = 1.0e9  # per row and layer at head size 128 (about 0.9 ms on an H200)
    margin: float = 0.95  # sparse must win by this much: the model is approximate

    def sparse_cost(self, q_len: int, ctx_len: int, num_heads: int, head_size: int, density: float,
                    last_q: int) -> float:
        estimate = self.estimate_key * min(last_q, q_len) * (ctx_len + q_len) * num_heads
        fixed = self.row_overhead * 128 / head_size
        return estimate + fixed + self.sparse_pair * density * causal_pairs(q_len, ctx_len, num_heads)

    def sparse_pays(self, q_len: int, ctx_len: int, num_heads: int, head_size: int, density: float,
                    last_q: int) -> bool:
        """Whether the sparse path is predicted faster than FlashAttention on this row."""
        dense = causal_pairs(q_len, ctx_len, num_heads)
        return self.sparse_cost(q_len, ctx_len, num_heads, head_size, density, last_q) < self.margin * dense


ROW_COST = RowCost()


class LayerDensityHistory:
    """One attention layer's memory across its calls, kept by the backend's impl:

    * ``expansion``: computed density / budget density of the layer's last estimated rows
      (weighted by their causal pairs); ``None`` until a row was measured, then the predicted
      density of a row is its budget density times this (at most 1);
    * whether the last known call had rows whose estimate came out denser than ``max_density``
      (for ``estimated_dense_rows="auto"``).

    Reading the densities on the host costs one sync per layer (the GPU queue drains and the
    next launches are exposed). Where the call reads its flags on the host anyway the densities
    come with them (:meth:`observed`); otherwise they are copied to pinned memory behind an event
    (:meth:`watch`) and taken in on a later call, once the GPU has computed them: never waiting.

    A row the model sends dense is not estimated, so nothing would correct an expansion that
    traffic has outgrown: one such row in ``PROBE_EVERY`` is estimated anyway (:meth:`probe_due`).
    """

    PROBE_EVERY = 32

    def __init__(self) -> None:
        self.expansion: float | None = None
        self._flagged: bool | None = None  # the last known call's answer; None: read on the host
        # (host copy of the densities, its CUDA event or None, the rows' budget densities and causal pairs)
        self._pending: tuple[torch.Tensor, object, list[float], list[int], float] | None = None
        self._pinned: torch.Tensor | None = None  # grown, never shrunk: a pinned allocation can sync
        self._skipped = 0

    def _take_pending(self) -> None:
        if self._pending is None:
            return
        host, done, budgets, causal, max_density = self._pending
        if done is not None and not done.query():
            return  # the GPU has not got there yet: the older answer stays in force
        self._pending = None
        self._learn(host[:len(budgets)].tolist(), budgets, causal, max_density)

    def _learn(self, densities: list[float], budgets: list[float], causal: list[int], max_density: float) -> None:
        self._flagged = any(d > max_density for d in densities)
        allowed = sum(b * c for b, c in zip(budgets, causal))
        if allowed > 0:
            self.expansion = sum(d * c for d, c in zip(densities, causal)) / allowed

    def predicted_density(self, budget_density: float) -> float:
        self._take_pending()
        return min(1.0, budget_density * (1.0 if self.expansion is None else max(self.expansion, 1.0)))

    def probe_due(self) -> bool:
        """Called for each row the model sends dense: True once in ``PROBE_EVERY`` (estimate it)."""
        self._skipped += 1
        if self._skipped >= self.PROBE_EVERY:
            self._skipped = 0
            return True
        return False

    def read_on_host(self) -> bool:
        """Whether this call should read its flags on the host (``estimated_dense_rows="auto"``):
        while the last known call had flagged rows, or nothing is known yet."""
        self._take_pending()
        return self._flagged is not False

    def observed(self, densities: list[float], budgets: list[float], causal: list[int], max_density: float) -> None:
        """The densities this call read on the host, with its rows' budget densities and causal pairs."""
        self._pending = None
        self._learn(densities, budgets, causal, max_density)

    def watch(self, densities: torch.Tensor, budgets: list[float], causal: list[int], max_density: float) -> None:
        """Densities left on the device: copied to pinned host memory without waiting, taken in later."""
        if not densities.is_cuda:
            self._pending = (densities.detach().clone(), None, budgets, causal, max_density)
            return
        n = densities.numel()
        if self._pinned is None or self._pinned.numel() < n:
            self._pinned = torch.empty(max(n, 8), dtype=densities.dtype, pin_memory=True)
        host = self._pinned  # a later copy into it is queued behind this one on the stream
        host[:n].copy_(densities, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pending = (host, done, budgets, causal, max_density)
