"""`vllm-sparse` command: tools around the backend (the backend itself runs inside vLLM).

  vllm-sparse import-minference IN.json OUT.json --model NAME   convert MInference's per-head file
  vllm-sparse check-head-config FILE.json [--model DIR]         validate a head-config file (and
                                                                 that it fits the model in DIR)
  vllm-sparse settings                                           validate and print the effective
                                                                 settings (and their head-config file)
  vllm-sparse search-patterns --model DIR --out FILE.json        kernel-aware per-head search
      [--length 16384] [--density 0.3] [--samples 2] [--device auto] [--text FILE]
  vllm-sparse demo [...]                                         passkey demo through vllm serve
"""

from __future__ import annotations

import argparse
import json
import sys

from .config import ConfigError, load_settings
from .head_configs import check_fits_model, import_minference, load_head_config, read_model_shape, save_head_config
from .startup import check_settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-sparse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("import-minference", help="convert a MInference per-head config")
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--model", required=True, help="model name recorded in the file")
    p = sub.add_parser("check-head-config", help="validate a head-config file")
    p.add_argument("path")
    p.add_argument("--model", help="Hugging Face model folder: the file must fit its config.json "
                   "(num_hidden_layers, num_attention_heads, num_key_value_heads)")
    sub.add_parser("settings", help="validate and print the settings VLLM_SPARSE_* / VLLM_SPARSE_CONFIG give "
                   "(and the head-config file they name)")
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
    p = sub.add_parser("demo", help="passkey demo through a real vLLM server", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)

    try:
        if args.cmd == "import-minference":
            try:
                with open(args.input, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ConfigError(f"{args.input}: {e}") from None
            cfg = import_minference(data, args.model, source=args.input)
            save_head_config(cfg, args.output)
            print(f"wrote {args.output}: {cfg.num_layers} layers x {cfg.num_heads} heads")
        elif args.cmd == "check-head-config":
            cfg = load_head_config(args.path)
            fits = ""
            if args.model:
                check_fits_model(cfg, read_model_shape(args.model), args.path)
                fits = f"; fits {args.model}"
            print(f"{args.path}: OK ({cfg.model}, {cfg.num_layers} layers x {cfg.num_heads} heads{fits})")
        elif args.cmd == "settings":
            settings, head_config = check_settings()
            print(json.dumps(settings.model_dump(mode="json"), indent=1))
            if head_config is not None:  # stderr: stdout stays one JSON document
                print(f"head_config {settings.head_config}: OK ({head_config.model}, {head_config.num_layers} "
                      f"layers x {head_config.num_heads} heads)", file=sys.stderr)
        elif args.cmd == "search-patterns":
            return _search_patterns(args)
        elif args.cmd == "demo":
            from .tools.demo import main as demo_main
            return demo_main(args.rest)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _search_patterns(args) -> int:
    """Calibration prompts: needle-retrieval prompts of ``--length`` tokens cut from offline text
    with the model's own tokenizer (:func:`vllm_sparse_backend.tools.search.calibration_prompts`)."""
    import os
    from pathlib import Path

    from transformers import AutoTokenizer

    from .tools.search import calibration_prompts, search_model

    if not (Path(args.model) / "config.json").is_file():
        raise ConfigError(f"--model {args.model}: not a Hugging Face model folder (no config.json)")
    if not 0.0 < args.density <= 1.0:
        raise ConfigError(f"--density {args.density}: must be in (0, 1]")
    if args.length < 128 or args.samples < 1 or args.rows < 1 or args.tail_rows < 0:
        raise ConfigError("--length must be >= 128, --samples and --rows >= 1, --tail-rows >= 0")
    text_path = args.text
    if text_path is None:
        from .tools.assets import ensure_text
        text_path = str(ensure_text())
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


if __name__ == "__main__":
    sys.exit(main())
