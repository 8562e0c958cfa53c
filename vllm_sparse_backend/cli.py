"""`vllm-sparse` command: tools around the backend (the backend itself runs inside vLLM).

  vllm-sparse import-minference IN.json OUT.json --model NAME   convert MInference's per-head file
  vllm-sparse check-head-config FILE.json                       validate a head-config file
  vllm-sparse settings                                           print the effective settings
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
        elif args.cmd == "demo":
            from .demo import main as demo_main
            return demo_main(args.rest)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
