"""The offline-tool subcommands of ``vllm-sparse`` (the command itself: :mod:`vllm_sparse_backend.cli`).

  vllm-sparse search-patterns --model DIR --out FILE.json   kernel-aware per-head search (search.py)
  vllm-sparse layer-budgets RECALL.json --model DIR --density D --out FILE.json
                                                            per-layer budgets from a recall run (layer_budgets.py)
  vllm-sparse demo [...]                                    passkey demo through vllm serve (demo.py)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..config import ConfigError, load_settings
from ..head_configs import load_head_config
from . import assets, demo, layer_budgets

def add_tool_commands(sub) -> None:
    """Add the tool subcommands to ``vllm-sparse``'s subparsers."""
    p = sub.add_parser("search-patterns", help="kernel-aware per-head pattern search (MInference Alg. 1)",
                       description="Kernel-aware pattern search at the serving length: per layer and KV "
                       "group (or head), the candidate family with the lowest output error against dense "
                       "attention at the same kernel cost (--density of the causal key tiles).")
    p.add_argument("--model", required=True, help="Hugging Face model folder (transformers loads it)")
    p.add_argument("--out", required=True, help="head-config JSON to write (with <out>.partial.json as "
                   "the run goes)")
    p.add_argument("--name", help="model name recorded in the file (default: folder name)")
    p.add_argument("--length", "--tokens", dest="length", type=int, default=16384,
                   help="calibration prompt length in tokens (the length the file is meant for; "
                   "default 16384, one CUDA prefill chunk)")
    p.add_argument("--samples", type=int, default=2, help="calibration prompts (different text offsets)")
    p.add_argument("--density", type=float, default=0.3, help="kernel cost every candidate is tuned to, "
                   "as a share of the causal key tiles per head (default 0.3)")
    p.add_argument("--rows", type=int, default=512, help="query rows per layer scored by output error "
                   "(default 512)")
    p.add_argument("--tail-rows", type=int, default=64, help="of those, the prompt's last rows "
                   "(default 64)")
    p.add_argument("--selection", choices=["group", "head", "auto"], default="auto",
                   help="group: one pattern and budgets per KV group (the backend shares one selection "
                   "per group, kv_group_shared); head: per query head (for kv_group_shared=false); "
                   "auto (default): group when the settings' kv_group_shared is on")
    p.add_argument("--max-budget-density", type=float, default=None,
                   help="keep every candidate's budgets (keys per query: vertical + slash, sink + window, "
                   "top-k x block) within this share of the keys a query sees at --length, where the "
                   "CUDA backend's density gate runs the layer sparse (default: the settings' "
                   "max_density, 0.4; 1 = no cap)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (default: cuda when available)")
    p.add_argument("--dtype", default="auto", help="model dtype: auto (bfloat16 on CUDA, float32 on CPU), "
                   "float32, bfloat16")
    p.add_argument("--yarn", type=float, default=None, help="YaRN rope factor (e.g. 4) for prompts "
                   "beyond the model's trained context")
    p.add_argument("--text", help="calibration text file (default: the offline Austen/Shakespeare text "
                   "from the asset cache)")
    p.add_argument("--seed", type=int, default=0, help="passcodes and sampled rows")
    p.add_argument("--resume", action="store_true", help="reuse the layers <out>.partial.json holds "
                   "for the same inputs")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip the final pass "
                   "that measures the file's achieved density and error on the calibration prompts")
    p = sub.add_parser("layer-budgets", help="per-layer vertical-slash budgets from an attention_recall run",
                       description="One budget rung per layer from a benchmarks/attention_recall.py run over a "
                       "ladder of vertical-slash budgets (and dense): the least summed loss with the mean "
                       "measured density within --density. Writes a head-config file.")
    p.add_argument("recall", help="attention_recall JSON (benchmarks/results/attention_recall_*.json)")
    p.add_argument("--model", required=True, help="model folder (its config.json gives layers and heads)")
    p.add_argument("--density", type=float, required=True, help="mean measured density over layers to stay "
                   "within (computed pairs / causal pairs, as the recall run measured them)")
    p.add_argument("--out", required=True, help="head-config JSON to write")
    p.add_argument("--rungs", nargs="+", default=None, help="variant labels of the run to use (default: "
                   "every vertical-slash or dense variant)")
    p.add_argument("--objective", choices=["error", "recall"], default="error",
                   help="loss per layer: relative output error (default) or lost softmax mass")
    p.add_argument("--lengths", nargs="+", type=int, default=None, help="lengths of the run to average "
                   "over (default: all)")
    p.add_argument("--name", help="model name recorded in the file (default: folder name)")
    p = sub.add_parser("demo", help="passkey demo through a real vLLM server", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)


def run_tool_command(args) -> int:
    """Run a tool subcommand parsed by :func:`add_tool_commands`; ConfigError for bad input."""
    if args.cmd == "search-patterns":
        return _search_patterns(args)
    if args.cmd == "layer-budgets":
        return _layer_budgets(args)
    if args.cmd == "demo":
        return demo.main(args.rest)
    raise ValueError(f"not a tool command: {args.cmd}")


def _layer_budgets(args) -> int:
    picks = layer_budgets.run(args.recall, args.model, args.density, args.out, labels=args.rungs,
                              objective=args.objective, lengths=args.lengths, name=args.name)
    mean = sum(c.density for c in picks) / len(picks)
    print("layer " + " ".join(f"{c.layer}:{c.rung.label}" for c in picks))
    print(f"wrote {args.out}: mean measured density {mean:.3f} (target {args.density}), summed "
          f"{args.objective} {sum(c.loss for c in picks):.4f}")
    return 0


def _search_patterns(args) -> int:
    """Calibration prompts: needle-retrieval prompts of ``--length`` tokens cut from offline text
    with the model's own tokenizer (:func:`vllm_sparse_backend.tools.search.calibration_prompts`)."""
    # Imported when the search runs: the search pulls in torch and transformers, which the other
    # `vllm-sparse` commands (settings, check-head-config, demo) should not pay for at start-up.
    from transformers import AutoTokenizer

    from .search import calibration_prompts, search_model

    if not (Path(args.model) / "config.json").is_file():
        raise ConfigError(f"--model {args.model}: not a Hugging Face model folder (no config.json)")
    if not 0.0 < args.density <= 1.0:
        raise ConfigError(f"--density {args.density}: must be in (0, 1]")
    if args.length < 128 or args.samples < 1 or args.rows < 1 or args.tail_rows < 0:
        raise ConfigError("--length must be >= 128, --samples and --rows >= 1, --tail-rows >= 0")
    text_path = args.text
    if text_path is None:
        text_path = str(assets.ensure_text())
    try:
        text = Path(text_path).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ConfigError(f"--text {text_path}: {e}") from None
    tok = AutoTokenizer.from_pretrained(args.model)
    try:
        samples = calibration_prompts(lambda s: tok.encode(s, add_special_tokens=False), text, args.length,
                                      args.samples, args.seed)
    except ValueError as e:
        raise ConfigError(f"{text_path}: {e}") from None
    settings = load_settings()
    selection = args.selection
    if selection == "auto":
        selection = "group" if settings.kv_group_shared else "head"
    cap = settings.max_density if args.max_budget_density is None else args.max_budget_density
    if not 0.0 < cap <= 1.0:
        raise ConfigError(f"--max-budget-density {cap}: must be in (0, 1]")
    name = args.name or Path(args.model).resolve().name
    try:
        cfg = search_model(args.model, samples, args.density, settings, name, os.path.basename(text_path),
                           log=lambda m: print(m, flush=True), device=args.device, dtype=args.dtype,
                           yarn=args.yarn, rows=args.rows, tail_rows=args.tail_rows, selection=selection,
                           seed=args.seed, out_path=args.out, resume=args.resume, verify=args.verify,
                           max_budget_density=None if cap >= 1.0 else cap)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    counts: dict[str, int] = {}
    for layer in cfg.layers:
        for h in layer.heads:
            counts[h.pattern.value] = counts.get(h.pattern.value, 0) + 1
    load_head_config(args.out)  # what check-head-config and the backend run
    achieved = cfg.settings.get("achieved", {})
    print(f"wrote {args.out}: {cfg.num_layers} layers x {cfg.num_heads} heads; patterns {counts}; "
          f"{args.length} tokens, density target {args.density}, achieved density "
          f"{achieved.get('density', float('nan')):.3f} (tiles {achieved.get('tile_density', float('nan')):.3f}); "
          f"{cfg.settings['total_seconds']:.0f} s", flush=True)
    return 0
