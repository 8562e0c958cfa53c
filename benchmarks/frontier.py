"""Score against time-to-first-token speedup: one point per variant and prompt length.

Reads the JSON files ``benchmarks/accuracy.py`` writes (one per model) and draws, per model, each
variant's mean score (every task of that length) against its TTFT speedup over the run's first
variant (the dense baseline, FLASH_ATTN on CUDA) on the same prompts, the score drawn as the
difference to the baseline's at that length (parity is judged against dense at the same length);
points of one variant are joined in length order and labelled with the length and the computed
attention density. The baseline sits at (1, 0). Up and to the right is better: what a variant
buys in time and what it costs in answers (one prompt of one task at 3 prompts per task and 6
tasks moves a cell's mean by up to 1/18 = 0.056).

    python -m benchmarks.frontier benchmarks/results/accuracy_h200_qwen-coder-1.5b_*.json \\
        benchmarks/results/accuracy_h200_qwen-coder_*.json --out docs/frontier.png

Needs matplotlib (not a dependency of the package: ``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

if not __package__:
    raise SystemExit("run from the repository root: python -m benchmarks.frontier ...")

from vllm_sparse_tools.evaluation import accuracy as acc  # noqa: E402


def points(run: dict[str, Any]) -> dict[str, list[tuple[int, float, float, float]]]:
    """Per variant, (length, TTFT speedup over the first variant, mean score minus the first
    variant's at that length, whole-prompt density) for every length it ran, from an accuracy run's JSON (recomputed from its
    results, so older files without ``by_length`` work too). The first variant's speedup is 1."""
    labels = list(run["meta"]["variants"])
    results = [acc.Result(**r) for r in run["results"]]
    out: dict[str, list[tuple[int, float, float, float]]] = {}
    for row in acc.by_length(results, labels):
        base = row.get(labels[0])
        if base is None:
            continue
        for i, v in enumerate(labels):
            c = row.get(v)
            if c is None or (i and c["speedup"] is None):
                continue
            dens = 1.0 if c["density_all"] is None else c["density_all"]
            out.setdefault(v, []).append((row["tokens"], 1.0 if i == 0 else c["speedup"],
                                          c["accuracy"] - base["accuracy"], dens))
    return out


def draw(runs: list[tuple[str, dict]], out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 5.2), squeeze=False)
    for ax, (title, run) in zip(axes[0], runs):
        pts = points(run)
        base = next(iter(pts))
        for v, series in pts.items():
            series = sorted(series)
            xs, ys = [p[1] for p in series], [p[2] for p in series]
            if v == base:
                ax.scatter([1.0], [0.0], marker="*", s=160, color="black", label=f"{v} (baseline)", zorder=3)
                continue
            line, = ax.plot(xs, ys, marker="o", label=v, alpha=0.85)
            for n, x, y, d in series:
                ax.annotate(f"{acc.length_label(n)} ({d:.2f})", (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=7, color=line.get_color())
        ax.axvline(1.0, color="grey", lw=0.8, ls=":")
        ax.axhline(0.0, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"TTFT speedup over {base} (same prompts)")
        ax.set_ylabel(f"mean score - {base}'s, same prompts (all tasks)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    fig.suptitle("score vs time to first token, per variant; labels: length (computed attention density)",
                 fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=pathlib.Path, help="accuracy JSON files, one panel each")
    ap.add_argument("--out", type=pathlib.Path, required=True, help="PNG to write")
    args = ap.parse_args(argv)
    runs = []
    for path in args.results:
        run = json.loads(path.read_text())
        meta = run["meta"]
        runs.append((f"{meta['model']}, {meta['device']}\n{path.stem}", run))
    draw(runs, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
