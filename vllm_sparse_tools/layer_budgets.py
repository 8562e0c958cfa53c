"""Per-layer vertical-slash budgets from measured recall at the serving length.

One budget for every layer wastes pairs: on Qwen2.5-Coder-1.5B at 130K (attention_recall.py,
16K chunks, library gating) vertical-slash 250 / 1000 keeps 92% of the softmax mass in layers
7 and 18 but 77-82% in layers 16, 17 and 27 (attention_recall_h200_qwen-coder-1.5b_served_2026-11-24). This tool takes a ``benchmarks/attention_recall.py``
run over a ladder of vertical-slash budgets (and optionally ``dense``), measured the way the
server runs them (chunks, gating), and picks one rung per layer: the per-layer choice that
minimises the summed loss (relative output error, or lost softmax mass) while the mean measured
density over layers stays within a target. The choice is the Lagrangian one (each layer takes
the rung minimising ``loss + lam * density``; ``lam`` is the smallest that meets the target), so
a layer pays for pairs only where they buy the most accuracy.

The result is an ordinary head-config file (``head_configs/README.md``): every head of a layer
gets the layer's rung, so KV-group sharing is unaffected.

    vllm-sparse layer-budgets RECALL.json --model DIR --density 0.15 --out FILE.json

Measured on that model at 130K (README, Accuracy): the per-layer files scored below one budget
for every layer at a higher density; output error on a calibration prompt does not rank
assignments by task score there.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from vllm_sparse_backend.config import ConfigError
from vllm_sparse_backend.settings import SparseSettings
from vllm_sparse_backend.head_configs import (FORMAT_NAME, HeadConfigFile, HeadPattern, LayerHeads, check_fits_model, read_model_shape,
                            save_head_config)
from vllm_sparse_backend.prefill.patterns import get_pattern

# The rungs' budgets: vertical-slash's head parameters, as its pattern declares them. A rung may
# carry these and default_pattern; anything else (bands, shares, other patterns) changes more
# than the budget and cannot be written as a per-head budget.
_BUDGETS = get_pattern("vertical_slash").head_fields
_RUNG_KEYS = {*_BUDGETS, "default_pattern"}


@dataclass(frozen=True)
class Rung:
    """One candidate for a layer: a variant of the recall run, as a head pattern."""

    label: str
    pattern: HeadPattern


@dataclass(frozen=True)
class LayerChoice:
    layer: int
    rung: Rung
    density: float
    loss: float


def ladder_from_variants(variants: dict[str, dict[str, Any]], labels: Sequence[str] | None = None) -> list[Rung]:
    """The recall run's variants usable as per-layer rungs: vertical-slash with budgets (missing
    budgets take the library defaults, as the run did) or dense."""
    defaults = SparseSettings().patterns.vertical_slash
    rungs = []
    for label, over in variants.items():
        if labels is not None and label not in labels:
            continue
        if set(over) - _RUNG_KEYS:
            if labels is not None:
                raise ConfigError(f"variant {label!r} sets {sorted(set(over) - _RUNG_KEYS)}: a ladder rung "
                                  f"may set only {', '.join(_BUDGETS)} or default_pattern")
            continue
        pattern = over.get("default_pattern", "vertical_slash")
        if pattern == "dense":
            rungs.append(Rung(label, HeadPattern(pattern="dense")))
        elif pattern == "vertical_slash":
            rungs.append(Rung(label, HeadPattern(pattern="vertical_slash", **{
                name: int(over.get(name, getattr(defaults, name))) for name in _BUDGETS})))
        elif labels is not None:
            raise ConfigError(f"variant {label!r}: pattern {pattern!r} is not a ladder rung")
    if labels is not None:
        missing = [lab for lab in labels if lab not in variants]
        if missing:
            raise ConfigError(f"variants {missing} are not in the recall run (it has {sorted(variants)})")
    if not rungs:
        raise ConfigError("the recall run has no vertical-slash or dense variant to use as a rung")
    return rungs


def layer_table(layers: dict[str, list[dict]], rungs: Sequence[Rung], objective: str,
                lengths: Sequence[int] | None = None) -> dict[int, dict[str, tuple[float, float]]]:
    """``{layer: {rung label: (density, loss)}}`` averaged over the chosen lengths of the run."""
    if objective not in ("error", "recall"):
        raise ConfigError(f"objective {objective!r}: use 'error' or 'recall'")
    keys = [str(n) for n in lengths] if lengths else list(layers)
    missing = [k for k in keys if k not in layers]
    if missing:
        raise ConfigError(f"lengths {missing} are not in the recall run (it has {list(layers)})")
    want = {r.label for r in rungs}
    acc: dict[int, dict[str, list[tuple[float, float]]]] = {}
    for key in keys:
        for row in layers[key]:
            if row["variant"] not in want:
                continue
            loss = row["error"] if objective == "error" else 1.0 - row["recall"]
            acc.setdefault(int(row["layer"]), {}).setdefault(row["variant"], []).append(
                (float(row["density"]), max(0.0, float(loss))))
    table = {}
    for layer, per in sorted(acc.items()):
        absent = want - set(per)
        if absent:
            raise ConfigError(f"layer {layer}: no measurement for {sorted(absent)}")
        table[layer] = {lab: (sum(d for d, _ in v) / len(v), sum(e for _, e in v) / len(v))
                        for lab, v in per.items()}
    return table


def choose(table: dict[int, dict[str, tuple[float, float]]], rungs: Sequence[Rung],
           density: float) -> list[LayerChoice]:
    """The rung per layer minimising the summed loss with mean density <= ``density``.

    Lagrangian relaxation: for a price ``lam`` per unit density each layer independently takes
    its cheapest ``loss + lam * density``; mean density falls as ``lam`` rises, so the smallest
    ``lam`` meeting the target is found by bisection (ties go to the lower density). If even the
    sparsest rungs exceed the target, they are returned and the caller reports the miss."""
    by_label = {r.label: r for r in rungs}

    def pick(lam: float) -> list[LayerChoice]:
        out = []
        for layer, opts in table.items():
            opts = {lab: v for lab, v in opts.items() if lab in by_label}
            label = min(opts, key=lambda lab: (opts[lab][1] + lam * opts[lab][0], opts[lab][0]))
            out.append(LayerChoice(layer, by_label[label], *opts[label]))
        return out

    def mean_density(choice: list[LayerChoice]) -> float:
        return sum(c.density for c in choice) / len(choice)

    lo, hi = 0.0, 1.0
    if mean_density(pick(lo)) <= density:
        return pick(lo)
    while mean_density(pick(hi)) > density and hi < 1e9:
        hi *= 4.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if mean_density(pick(mid)) <= density:
            hi = mid
        else:
            lo = mid
    return pick(hi)


def build_head_config(recall: dict, *, density: float, num_heads: int, num_kv_heads: int | None,
                      model: str, labels: Sequence[str] | None = None, objective: str = "error",
                      lengths: Sequence[int] | None = None, source: str = "") -> tuple[HeadConfigFile, list[LayerChoice]]:
    """A head-config file with one rung per layer chosen from an attention_recall run."""
    if not 0.0 < density <= 1.0:
        raise ConfigError(f"density {density}: must be in (0, 1]")
    meta = recall.get("meta", {})
    rungs = ladder_from_variants(meta.get("variants", {}), labels)
    table = layer_table(recall["layers"], rungs, objective, lengths)
    picks = choose(table, rungs, density)
    num_layers = max(table) + 1
    if sorted(table) != list(range(num_layers)):
        raise ConfigError(f"the recall run measured layers {sorted(table)}, not every layer 0..{num_layers - 1}")
    achieved = sum(c.density for c in picks) / len(picks)
    used_lengths = [int(k) for k in (lengths or recall["layers"])]
    settings = {
        # Every head of a layer has the same rung, so the file is uniform within any KV group.
        "selection": "per_kv_group",
        "tool": "layer-budgets", "objective": objective, "density_target": density,
        "density_measured_mean": round(achieved, 4), "lengths": used_lengths,
        "loss_sum": round(sum(c.loss for c in picks), 5), "rungs": [r.label for r in rungs],
        "per_layer": [{"layer": c.layer, "rung": c.rung.label, "density": round(c.density, 4),
                       "loss": round(c.loss, 5)} for c in picks],
        "recall_run": {k: meta.get(k) for k in ("model", "text", "task", "device", "dtype", "yarn", "chunk",
                                                "gating", "rows", "date", "torch")},
        "date": datetime.date.today().isoformat()}
    cfg = HeadConfigFile(
        format=FORMAT_NAME, version=1, model=model, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        produced_by=(f"vllm-sparse layer-budgets from {source or 'an attention_recall run'}: one rung of "
                     f"{[r.label for r in rungs]} per layer, least summed {objective} with mean measured "
                     f"density <= {density} at {used_lengths} tokens (achieved {achieved:.3f})"),
        settings=settings,
        layers=[LayerHeads(heads=[c.rung.pattern] * num_heads) for c in picks])
    return cfg, picks


def run(recall_path: str, model_dir: str, density: float, out: str, *, labels: Sequence[str] | None = None,
        objective: str = "error", lengths: Sequence[int] | None = None, name: str | None = None) -> list[LayerChoice]:
    """CLI body: read the recall JSON and the model's config.json, write the head config."""
    try:
        recall = json.loads(Path(recall_path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{recall_path}: cannot read the attention_recall JSON: {e}") from None
    if "layers" not in recall or "meta" not in recall:
        raise ConfigError(f"{recall_path}: not an attention_recall JSON (no 'meta' / 'layers')")
    shape = read_model_shape(model_dir)
    cfg, picks = build_head_config(recall, density=density, num_heads=shape.num_heads,
                                   num_kv_heads=shape.num_kv_heads,
                                   model=name or Path(model_dir).resolve().name, labels=labels,
                                   objective=objective, lengths=lengths, source=Path(recall_path).name)
    check_fits_model(cfg, shape, out)  # what the server checks at start-up: layers measured = model's
    save_head_config(cfg, out)
    return picks
