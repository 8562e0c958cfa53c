"""`vllm-sparse` command: tools around the backend (the backend itself runs inside vLLM).

  vllm-sparse import-minference IN.json OUT.json --model NAME   convert MInference's per-head file
  vllm-sparse check-head-config FILE.json                       validate a head-config file
  vllm-sparse settings                                           print the effective settings
  vllm-sparse search-patterns --model DIR --out FILE.json        kernel-aware per-head search
  vllm-sparse demo [...]                                         passkey demo through vllm serve
"""

from __future__ import annotations

import argparse
import json
import sys

from .config import ConfigError, load_settings
from .head_configs import import_minference, load_head_config, save_head_config


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
    sub.add_parser("settings", help="print the settings VLLM_SPARSE_* / VLLM_SPARSE_CONFIG give")
    p = sub.add_parser("search-patterns", help="kernel-aware per-head pattern search (MInference Alg. 1)")
    p.add_argument("--model", required=True, help="Hugging Face model folder (transformers loads it)")
    p.add_argument("--out", required=True, help="head-config JSON to write")
    p.add_argument("--name", help="model name recorded in the file (default: folder name)")
    p.add_argument("--tokens", type=int, default=4096, help="calibration prompt length")
    p.add_argument("--samples", type=int, default=1, help="calibration prompts (different text offsets)")
    p.add_argument("--density", type=float, default=0.3, help="kernel cost of every candidate, as a "
                   "fraction of the causal key tiles")
    p.add_argument("--text", help="calibration text file (default: the offline Austen/Shakespeare text)")
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
            print(f"{args.path}: OK ({cfg.model}, {cfg.num_layers} layers x {cfg.num_heads} heads)")
        elif args.cmd == "settings":
            print(json.dumps(load_settings().model_dump(mode="json"), indent=1))
        elif args.cmd == "search-patterns":
            return _search_patterns(args)
        elif args.cmd == "demo":
            from .demo import main as demo_main
            return demo_main(args.rest)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _search_patterns(args) -> int:
    """Calibration prompts: a needle-retrieval prompt per sample (MInference searched on a
    retrieval sample) cut from offline text with the model's own tokenizer."""
    import os
    import random
    from pathlib import Path

    from transformers import AutoTokenizer

    from .search import search_model

    if not (Path(args.model) / "config.json").is_file():
        raise ConfigError(f"--model {args.model}: not a Hugging Face model folder (no config.json)")
    text_path = args.text
    if text_path is None:
        from .assets import ensure_text
        text_path = str(ensure_text())
    text = Path(text_path).read_text(encoding="utf-8", errors="replace")
    tok = AutoTokenizer.from_pretrained(args.model)
    rng = random.Random(0)
    samples = []
    for n in range(args.samples):
        key = rng.randint(10000, 99999)
        needle = f" The secret passcode for the blue door is {key}. "
        question = tok.encode("\n\nWhat is the secret passcode for the blue door? It is", add_special_tokens=False)
        start = (len(text) // max(1, args.samples)) * n
        hay = tok.encode(text[start:start + 8 * args.tokens], add_special_tokens=False)
        hay = hay[: args.tokens - len(question) - 32]
        if len(hay) + len(question) < args.tokens // 2:
            raise ConfigError(f"{text_path}: too little text for a {args.tokens}-token prompt")
        mid = len(hay) // 2
        samples.append(hay[:mid] + tok.encode(needle, add_special_tokens=False) + hay[mid:] + question)
    settings = load_settings()
    name = args.name or Path(args.model).resolve().name
    cfg = search_model(args.model, samples, args.density, settings, name, os.path.basename(text_path),
                       log=lambda m: print(m, flush=True))
    save_head_config(cfg, args.out)
    counts: dict[str, int] = {}
    for layer in cfg.layers:
        for h in layer.heads:
            counts[h.pattern.value] = counts.get(h.pattern.value, 0) + 1
    print(f"wrote {args.out}: {cfg.num_layers} layers x {cfg.num_heads} heads; patterns {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
