"""`vllm-sparse` command: tools around the backend (the backend itself runs inside vLLM).

  vllm-sparse import-minference IN.json OUT.json --model NAME   convert MInference's per-head file
  vllm-sparse check-head-config FILE.json [--model DIR]         validate a head-config file (and
                                                                 that it fits the model in DIR)
  vllm-sparse settings                                           validate and print the effective
                                                                 settings (and their head-config file)
  vllm-sparse search-patterns --model DIR --out FILE.json        kernel-aware per-head search
      [--length 16384] [--density 0.3] [--samples 2] [--device auto] [--text FILE]
  vllm-sparse layer-budgets RECALL.json --model DIR --density D --out FILE.json
                                                                 per-layer budgets from a recall run
  vllm-sparse demo [...]                                         passkey demo through vllm serve

The first three commands come from the serving core; ``search-patterns``, ``layer-budgets`` and ``demo`` from the
offline tools (:mod:`vllm_sparse_backend.tools.cli`). This module sits above both layers and
vLLM never imports it.
"""

from __future__ import annotations

import argparse
import json
import sys

from .config import ConfigError
from .head_configs import check_fits_model, import_minference, load_head_config, read_model_shape, save_head_config
from .startup import check_settings
from .tools.cli import add_tool_commands, run_tool_command


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
    add_tool_commands(sub)
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
        else:
            return run_tool_command(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
