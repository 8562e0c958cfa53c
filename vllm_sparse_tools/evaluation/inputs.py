"""The command-line names of the evaluation's inputs: model, haystack text and variants.

Shared by ``benchmarks/accuracy.py`` and ``benchmarks/attention_recall.py``, so that both accept
the same names and resolve them to the same cached assets.
"""

from __future__ import annotations

import argparse
import pathlib
from dataclasses import dataclass
from typing import Sequence

from .. import assets
from . import host_kv
from .variants import PRESETS, Variant, parse_variant, searched_variant

# Name on the command line -> (asset in vllm_sparse_tools.assets, the model's own name).
MODELS: dict[str, tuple[str, str]] = {
    "smollm2": ("smollm2", "SmolLM2-135M-Instruct"),
    "qwen-coder": ("qwen-coder", "Qwen2.5-Coder-0.5B-Instruct"),
    "qwen-coder-1.5b": ("qwen-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct"),
}
# Text assets; "text" is Austen, or Shakespeare where apt is unavailable (as in the demo).
TEXTS = ("austen", "shakespeare", "bible", "text")


def resolve_model(spec: str) -> tuple[pathlib.Path, str]:
    """(Hugging Face folder, model name) for a name in :data:`MODELS` (fetched and converted on
    first use) or the path of a model folder."""
    if spec in MODELS:
        asset, name = MODELS[spec]
        return assets.ASSETS[asset](), name
    path = pathlib.Path(spec).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ValueError(f"model {spec!r} is neither one of {', '.join(MODELS)} nor a folder "
                         "with a config.json")
    return path, path.name


def resolve_text(spec: str) -> tuple[str, str]:
    """(the text, its file name) for a name in :data:`TEXTS` (fetched on first use) or the path
    of a UTF-8 text file."""
    path = assets.ASSETS[spec]() if spec in TEXTS else pathlib.Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"text {spec!r} is neither one of {', '.join(TEXTS)} nor a file")
    return path.read_text(encoding="utf-8", errors="replace"), path.name


def short_model_name(spec: str, model_name: str) -> str:
    """The model's part of a result file name: the command-line name, else the folder's."""
    return spec if spec in MODELS else model_name


def choose_variants(specs: Sequence[str], model_dir: pathlib.Path, model_name: str,
                    head_config_dir: str | pathlib.Path, *, add_searched: bool = False,
                    peers: bool = False) -> list[Variant]:
    """Parse variant specs (see :mod:`.variants`). ``searched`` names the model's per-head file
    ``<head_config_dir>/<model folder or name>.json``; with ``add_searched`` (the benchmarks'
    default variant lists) it is appended when such a file exists, so that a shipped
    configuration is measured without being asked for. ``LABEL=peer`` only where ``peers``."""
    searched = searched_variant([model_dir.name, model_name, model_name.lower()], head_config_dir)
    if "searched" in specs and searched is None:
        raise ValueError(f"variant 'searched': no head config for {model_name} in "
                         f"{head_config_dir}")
    if add_searched and searched is not None and "searched" not in specs:
        specs = [*specs, "searched"]
    variants = [searched if spec == "searched" else parse_variant(spec, peers) for spec in specs]
    labels = [v.label for v in variants]
    if len(set(labels)) != len(labels):
        raise ValueError(f"variant labels must be unique: {labels}")
    return variants


# ---------------------------------------------------------------------------------------------
# The benchmarks' common command-line arguments
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunInputs:
    model_dir: pathlib.Path
    model_name: str
    short_name: str  # for result file names: the command-line name, else the folder's
    text: str
    text_name: str
    variants: list[Variant]


def add_arguments(parser: argparse.ArgumentParser, default_variants: Sequence[str],
                  head_config_dir: str | pathlib.Path) -> None:
    """--model, --text, --variants and --head-config-dir, read back by :func:`from_arguments`."""
    parser.add_argument("--model", default="smollm2",
                        help=f"{', '.join(MODELS)}, or a model folder")
    parser.add_argument("--text", default="text",
                        help=f"{', '.join(TEXTS)} (text: Austen, else Shakespeare where apt is "
                             "unavailable), or a text file")
    parser.add_argument("--variants", nargs="+", default=None,
                        help="presets (" + ", ".join(PRESETS) + "), searched (the model's file "
                             "in --head-config-dir), or LABEL=FIELD=VALUE[,FIELD=VALUE...] with "
                             "settings fields; default: " + " ".join(default_variants)
                             + ", plus searched where the model has a file")
    parser.set_defaults(default_variants=list(default_variants))
    parser.add_argument("--head-config-dir", default=str(head_config_dir),
                        help="where 'searched' looks for <model folder or name>.json")


def from_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> RunInputs:
    """Resolve the arguments of :func:`add_arguments` (fetching assets on first use); a bad
    name ends the program with the parser's usage error."""
    try:
        model_dir, model_name = resolve_model(args.model)
        variants = choose_variants(args.variants or args.default_variants, model_dir, model_name,
                                   args.head_config_dir, add_searched=args.variants is None)
        text, text_name = resolve_text(args.text)
    except ValueError as e:
        parser.error(str(e))
    return RunInputs(model_dir, model_name, short_model_name(args.model, model_name), text,
                     text_name, variants)


def result_paths(out: str | None, default: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """``<out>.json`` and ``<out>.txt`` (``default`` when no ``--out`` was given), their folder
    made. ``with_name``, not ``with_suffix``: a name such as accuracy_h200_qwen-coder-1.5b holds
    a dot."""
    path = pathlib.Path(out or default)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name(path.name + ".json"), path.with_name(path.name + ".txt")


def add_model_and_variants_arguments(parser: argparse.ArgumentParser, variants_help: str,
                                     head_config_dir: str | pathlib.Path) -> None:
    """--model, --variants (default: dense and the library defaults) and --head-config-dir, read
    back by :func:`model_and_variants`: the servers' benchmarks (ruler, bench_serve)."""
    parser.add_argument("--model", default="smollm2", help=f"{', '.join(MODELS)}, or a model folder")
    parser.add_argument("--variants", nargs="+", default=["dense", "default"], help=variants_help)
    parser.add_argument("--head-config-dir", default=str(head_config_dir))


def model_and_variants(parser: argparse.ArgumentParser, args: argparse.Namespace, peers: bool = False
                       ) -> tuple[pathlib.Path, str, list[Variant]]:
    """``args.model`` resolved and ``args.variants`` parsed as given (no ``searched`` added; peers
    where ``peers``; kv_placement=host where ``args`` has :data:`.host_kv.FLAG`); a bad name ends
    the program with the parser's usage error."""
    try:
        model_dir, model_name = resolve_model(args.model)
        variants = choose_variants(args.variants, model_dir, model_name, args.head_config_dir, peers=peers)
        host_kv.refuse_unflagged(variants, args)
        return model_dir, model_name, variants
    except ValueError as e:
        parser.error(str(e))
