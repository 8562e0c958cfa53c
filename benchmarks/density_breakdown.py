"""Where a vertical-slash row's computed pairs come from: budget, selected lines, tiles, chunks.

Issue 20 asks why the full path computes more than the kernel alone on a planted index: at 128K
(Llama-3-8B shape, vertical-slash 1000 / 6096, one list per KV group) the estimated selection
covered 19.6% of the causal pairs where the planted index covers 8.6%. For one layer of the
planted Q / K that ``backend_path.py`` times (a local band of diagonals, sinks and ~500 strong
columns per KV head), estimated the way the backend does (last-q softmax, column and diagonal
sums over the KV group, top-k), this prints per settings variant and chunking, as shares of all
causal pairs of the prompt:

* ``budget``: what the budgets allow, min(keys before the query, vertical_size + slash_size)
  per query;
* ``lines``: the pairs the selected columns and diagonals really hold (their exact union,
  per query position: kept columns + kept diagonals - columns on a kept diagonal);
* ``computed``: what the kernel computes for the index those lines convert to (``count_pairs``;
  the conversion is the package's, :func:`lines_index`), split into the slash
  tiles (key blocks, or 64-key ranges with ``slash_tiles=ranges``) and the single columns left
  outside them; ``tiles / slash lines`` is the tiles' cost per pair of kept diagonal.

``--residual-slash`` adds a what-if per variant: diagonal sums that leave out the kept columns
(see :func:`kept_lines`). Everything runs in torch on the CPU (the estimation is the package's
torch path, which the GPU estimators are tested against)::

    python benchmarks/density_breakdown.py --n 131072 --heads 8 2
    python benchmarks/density_breakdown.py --n 32768 --chunk 16384 0

Heads only repeat the planted structure, so 8 / 2 heads give the shares of 32 / 8.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from backend_path import structured_qkv  # noqa: E402

from vllm_sparse_backend.prefill.budgets import kv_group_share  # noqa: E402
from vllm_sparse_backend.config import SparseSettings  # noqa: E402
from vllm_sparse_backend.head_configs import resolve_head  # noqa: E402
from vllm_sparse_backend.prefill.index import build_index, count_pairs  # noqa: E402
from vllm_sparse_backend.prefill.patterns import kv_head_map  # noqa: E402
from vllm_sparse_backend.prefill.patterns.base import (last_queries_probs, sum_head_groups,  # noqa: E402
                                                 vertical_and_slash_sums)
from vllm_sparse_backend.prefill.patterns.vertical_slash import (keep_columns, keep_diagonals,  # noqa: E402
                                                         vertical_slash_to_selection)
from vllm_sparse_tools.evaluation.variants import parse_variant  # noqa: E402


def kept_lines(q: torch.Tensor, k: torch.Tensor, ctx_len: int, cfg: SparseSettings, share: int,
               residual: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [lists, kv_len] kept columns and kept diagonals of one row, as the vertical-slash
    pattern chooses them (``patterns.vertical_slash.vertical_slash_selection``, default heads).

    ``residual`` (a what-if, no serving counterpart): the diagonal sums leave out the kept
    columns' probabilities, so that no slash budget goes to diagonals that score only through
    columns already kept (a sink seen by the last queries lands on the diagonals near their
    positions). On the planted 128K row it changes little (0.243 -> 0.219 computed, 16K chunks)."""
    kv_len = k.shape[0]
    kvh = kv_head_map(q.shape[1], k.shape[1], q.device)
    probs, qpos = last_queries_probs(q, k, kvh, ctx_len, cfg.last_q, q.shape[-1] ** -0.5)
    vertical, slash = vertical_and_slash_sums(probs, qpos)
    vertical, slash = sum_head_groups(vertical, share), sum_head_groups(slash, share)
    lists = vertical.shape[0]
    v_keep = keep_columns(vertical, torch.full((lists,), cfg.vertical_size), cfg.keep_first_columns)
    if residual:
        probs = probs.masked_fill(v_keep.repeat_interleave(share, 0)[:, None, :], 0.0)
        slash = sum_head_groups(vertical_and_slash_sums(probs, qpos)[1], share)
    s_keep = keep_diagonals(slash, torch.full((lists,), cfg.slash_size), cfg.keep_last_diagonals, ctx_len,
                            cfg.slash_band)
    return v_keep, s_keep


def lines_index(v_keep: torch.Tensor, s_keep: torch.Tensor, q_len: int, ctx_len: int, cfg: SparseSettings):
    """The SparseIndex the kernel gets for these kept lines (one head per list), converted as
    ``patterns.estimate_index`` converts them."""
    sel = vertical_slash_to_selection(v_keep, s_keep, q_len, ctx_len, cfg.block_size, cfg.slash_tiles)
    return build_index(sel.block_mask, cfg.block_size, q_len, ctx_len, sel.columns, sel.column_keep,
                       sel.range_count, sel.range_start)


def line_pairs(v_keep: torch.Tensor, s_keep: torch.Tensor, q_len: int, ctx_len: int) -> tuple[int, int]:
    """(pairs of the kept columns and diagonals together, pairs of the kept diagonals alone not
    on a kept column) over the row's queries, summed over lists. Query p sees key j <= p if
    column j or diagonal p - j is kept; both at once: the convolution of the two masks at p."""
    kv_len = v_keep.shape[-1]
    v, s = v_keep.double(), s_keep.double()
    cols = v.cumsum(-1)  # kept columns at or before p
    diags = s.cumsum(-1)  # kept diagonals d <= p
    size = 1 << (2 * kv_len - 1).bit_length()
    both = torch.fft.irfft(torch.fft.rfft(v, size) * torch.fft.rfft(s, size), size)[..., :kv_len].round()
    rows = slice(ctx_len, kv_len)
    total = (cols[:, rows] + diags[:, rows] - both[:, rows]).sum()
    slash_only = (diags[:, rows] - both[:, rows]).sum()
    return int(total), int(slash_only)


@dataclasses.dataclass
class Tally:
    causal: int = 0
    budget: int = 0
    lines: int = 0
    slash_lines: int = 0
    computed: int = 0
    tiles: int = 0

    def add(self, other: "Tally") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def row_tally(q, k, ctx_len: int, cfg: SparseSettings, residual: bool = False) -> Tally:
    """One row (a chunk of queries q at ctx_len, keys k of all its positions), per list, in
    pairs of one query head (every head of a list computes the same pairs)."""
    q_len, h, d = q.shape
    kv_len = k.shape[0]
    heads = [resolve_head(None, cfg)] * h
    share = kv_group_share(heads, k.shape[1], cfg)
    lists = h // share
    t = Tally()
    seen = torch.arange(ctx_len, kv_len, dtype=torch.float64) + 1  # keys each query sees
    t.causal = int(seen.sum()) * lists
    t.budget = int(seen.clamp(max=cfg.vertical_size + cfg.slash_size).sum()) * lists
    v_keep, s_keep = kept_lines(q, k, ctx_len, cfg, share, residual)
    t.lines, t.slash_lines = line_pairs(v_keep, s_keep, q_len, ctx_len)
    index = lines_index(v_keep, s_keep, q_len, ctx_len, cfg)
    t.computed = count_pairs(index, q_len, ctx_len)
    # (pairs are counted from the lists' -1 padding, not the counts)
    no_columns = dataclasses.replace(index, column_count=torch.zeros_like(index.column_count),
                                     column_index=torch.full_like(index.column_index, -1))
    t.tiles = count_pairs(no_columns, q_len, ctx_len)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=131072, help="prompt tokens")
    ap.add_argument("--heads", type=int, nargs=2, default=[8, 2], metavar=("H", "HKV"))
    ap.add_argument("--chunk", type=int, nargs="+", default=[16384, 0], help="prefill chunks (0: one row)")
    ap.add_argument("--variants", nargs="+", default=["default", "ranges=slash_tiles=ranges",
                                                      "bands=slash_band=64"],
                    help="presets or LABEL=FIELD=VALUE[,...] with settings fields (vllm_sparse_tools.evaluation.variants)")
    ap.add_argument("--residual-slash", action="store_true",
                    help="also each variant with diagonal sums that leave out the kept columns (a what-if)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    h, hkv = args.heads
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.monotonic()
    q, k, _ = structured_qkv(args.n, h, hkv, 128, gen, dev="cpu")
    q, k = q.float(), k.float()
    print(f"# planted Q / K (benchmarks/backend_path.py), {args.n} tokens, {h} / {hkv} heads of dim 128, "
          f"torch {torch.__version__} on CPU; shares of all causal pairs (one query head's, every list alike)")
    print("| variant | chunk | budget | lines | computed | of which slash tiles | of which columns | "
          "tiles / slash lines | computed / lines |")
    print("|---|---|---|---|---|---|---|---|---|")
    variants = [parse_variant(spec) for spec in args.variants]
    runs = [(v.label, v.settings(), False) for v in variants]
    if args.residual_slash:
        runs += [(f"{v.label}, residual slash", v.settings(), True) for v in variants]
    for label, cfg, residual in runs:
        for chunk in args.chunk:
            total = Tally()
            step = chunk or args.n
            for start in range(0, args.n, step):
                stop = min(args.n, start + step)
                total.add(row_tally(q[start:stop], k[:stop], start, cfg, residual))
            c = total.causal
            print(f"| {label} | {chunk or 'one row'} | {total.budget / c:.3f} | {total.lines / c:.3f} | "
                  f"{total.computed / c:.3f} | {total.tiles / c:.3f} | {(total.computed - total.tiles) / c:.3f} | "
                  f"{total.tiles / max(total.slash_lines, 1):.2f} | {total.computed / max(total.lines, 1):.2f} |",
                  flush=True)
    print(f"# {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
