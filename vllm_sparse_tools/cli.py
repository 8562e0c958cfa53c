"""The ``vllm-sparse`` command.

  vllm-sparse import-minference IN.json OUT.json --model NAME   convert MInference's per-head file
  vllm-sparse check-head-config FILE.json|NAME [--model DIR]    validate a head-config file or shipped
                                                                 name (and that it fits the model in DIR)
  vllm-sparse settings [--model DIR]                             validate and print the effective
                                                                 settings (and their head-config file)
  vllm-sparse search-patterns --model DIR --out FILE.json        kernel-aware per-head search (search.py)
      [--length 16384] [--density 0.3] [--samples 2] [--device auto] [--text FILE]
  vllm-sparse layer-budgets RECALL.json --model DIR --density D --out FILE.json
                                                                 per-layer budgets from a recall run
                                                                 (layer_budgets.py)
  vllm-sparse demo [--tokens 4000] [...]                         passkey demo through vllm serve (demo.py)

The first three wrap the serving package's own checks (:mod:`vllm_sparse_backend.head_configs`,
:mod:`vllm_sparse_backend.startup`), so a file or setting the command accepts is one a server
accepts. This module belongs to the tools package: vLLM never imports it, and the serving package
never imports it either (``tests/unit/test_layout.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from vllm_sparse_backend.config import ConfigError
from vllm_sparse_backend.head_configs import (check_fits_model, import_minference, load_head_config,
                                              read_model_shape, resolve_head_config, save_head_config,
                                              shipped_head_config_names)
from vllm_sparse_backend.startup import check_settings, load_checked_settings

from . import assets, demo, layer_budgets

DESCRIPTION = ("Tools for the sparse-prefill attention backend of vLLM: check and convert head-config "
               "files and settings, search per-head patterns for a model, and run a demo. The backend "
               "itself runs inside 'vllm serve MODEL --attention-backend sparse-prefill'.")
EPILOG = "Run 'vllm-sparse COMMAND --help' for the options of a command."
MODEL_HELP = ("Hugging Face model folder: the head-config file must fit its config.json (num_hidden_layers, "
              "num_attention_heads, num_key_value_heads), as the server checks when it builds the model")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-sparse", description=DESCRIPTION, epilog=EPILOG)
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    p = sub.add_parser("import-minference", help="convert a MInference per-head config",
                       description="Convert MInference's per-head pattern file (a JSON list of layers) "
                       "into a head-config file the backend reads (VLLM_SPARSE_HEAD_CONFIG).")
    p.add_argument("input", help="MInference's per-head JSON file")
    p.add_argument("output", help="head-config JSON file to write")
    p.add_argument("--model", required=True, help="model name recorded in the file")
    p.set_defaults(run=_import_minference)

    p = sub.add_parser("check-head-config", help="validate a head-config file",
                       description="Validate a head-config file the way the server does at start-up, "
                       "and optionally check that it fits a model.")
    p.add_argument("path", metavar="FILE_OR_NAME", help="head-config JSON file, or the name of a shipped one "
                   "as VLLM_SPARSE_HEAD_CONFIG takes it (" + ", ".join(shipped_head_config_names()) + ")")
    p.add_argument("--model", help=MODEL_HELP)
    p.set_defaults(run=_check_head_config)

    p = sub.add_parser("settings", help="validate and print the effective settings",
                       description="Validate the settings that VLLM_SPARSE_* and VLLM_SPARSE_CONFIG give "
                       "(and the head-config file they name) the way the server does, and print them "
                       "as JSON on stdout. A head-config file is checked against a model only with --model.")
    p.add_argument("--model", help=MODEL_HELP)
    p.set_defaults(run=_settings)

    p = sub.add_parser("search-patterns", help="kernel-aware per-head pattern search (MInference Alg. 1)",
                       description="Kernel-aware pattern search at the serving length: per layer and KV "
                       "group (or head), the candidate family with the lowest output error against dense "
                       "attention at the same kernel cost (--density of the causal key tiles). Writes a "
                       "head-config file. Needs the 'tools' extra (transformers).")
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
    p.set_defaults(run=_search_patterns)

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
    p.set_defaults(run=_layer_budgets)

    p = sub.add_parser("demo", help="passkey demo through a real vLLM server",
                       description=demo.DESCRIPTION + " The model and text are fetched once into the "
                       "asset cache (needs the 'tools' extra for the model's conversion).")
    demo.add_demo_arguments(p)
    p.set_defaults(run=demo.run_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _import_minference(args: argparse.Namespace) -> int:
    try:
        with open(args.input, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{args.input}: {e}") from None
    cfg = import_minference(data, args.model, source=args.input)
    save_head_config(cfg, args.output)
    print(f"wrote {args.output}: {cfg.num_layers} layers x {cfg.num_heads} heads")
    return 0


def _check_head_config(args: argparse.Namespace) -> int:
    cfg = resolve_head_config(args.path)
    fits = ""
    if args.model:
        check_fits_model(cfg, read_model_shape(args.model), args.path)
        fits = f"; fits {args.model}"
    print(f"{args.path}: OK ({cfg.model}, {cfg.num_layers} layers x {cfg.num_heads} heads{fits})")
    return 0


def _settings(args: argparse.Namespace) -> int:
    settings, head_config = check_settings()
    if head_config is not None and args.model:
        check_fits_model(head_config, read_model_shape(args.model), settings.head_config)
    print(json.dumps(settings.model_dump(mode="json"), indent=1))
    if head_config is not None:  # stderr: stdout stays one JSON document
        fits = (f"; fits {args.model}" if args.model else
                "; not checked against a model (the server checks it when it builds the model): "
                "add --model DIR to check it now")
        print(f"head_config {settings.head_config}: OK ({head_config.model}, {head_config.num_layers} "
              f"layers x {head_config.num_heads} heads){fits}", file=sys.stderr)
    elif args.model:
        print(f"no head_config set: every head of {args.model} uses the global settings", file=sys.stderr)
    return 0


def _layer_budgets(args: argparse.Namespace) -> int:
    picks = layer_budgets.run(args.recall, args.model, args.density, args.out, labels=args.rungs,
                              objective=args.objective, lengths=args.lengths, name=args.name)
    mean = sum(c.density for c in picks) / len(picks)
    print("layer " + " ".join(f"{c.layer}:{c.rung.label}" for c in picks))
    print(f"wrote {args.out}: mean measured density {mean:.3f} (target {args.density}), summed "
          f"{args.objective} {sum(c.loss for c in picks):.4f}")
    return 0


def _search_patterns(args: argparse.Namespace) -> int:
    """Calibration prompts: needle-retrieval prompts of ``--length`` tokens cut from offline text
    with the model's own tokenizer (:func:`vllm_sparse_tools.search.calibration_prompts`)."""
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
    settings = load_checked_settings()
    selection = args.selection
    if selection == "auto":
        selection = "group" if settings.kv_group_shared else "head"
    cap = settings.gating.max_density if args.max_budget_density is None else args.max_budget_density
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
            counts[h.pattern] = counts.get(h.pattern, 0) + 1
    load_head_config(args.out)  # what check-head-config and the backend run
    achieved = cfg.settings.get("achieved", {})
    print(f"wrote {args.out}: {cfg.num_layers} layers x {cfg.num_heads} heads; patterns {counts}; "
          f"{args.length} tokens, density target {args.density}, achieved density "
          f"{achieved.get('density', float('nan')):.3f} (tiles {achieved.get('tile_density', float('nan')):.3f}); "
          f"{cfg.settings['total_seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
