"""Peers: another project's sparse attention, served by the same ``vllm serve`` beside ours.

A peer variant (spec ``LABEL=peer``) runs vLLM's FLASH_ATTN backend with the peer's worker class
(``--worker-cls``), which swaps the layers' attention for the peer's once the model has loaded,
on a copy of the model folder whose ``config.json`` carries the peer's settings. The peer
measured today is NVIDIA ModelOpt's skip-softmax sparse attention (``nvidia-modelopt`` 0.47):
its worker reads ``sparse_attention_config`` from ``config.json``, either what ModelOpt's
calibration exported (``config_groups`` with a ``skip_softmax`` group and its fitted threshold
parameters) or :data:`UNCALIBRATED` (ModelOpt's fixed threshold), and it wants eager mode.
Neither the worker nor ModelOpt belongs to this project: the server imports them from the
folders of ``--peer-pythonpath``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
from dataclasses import dataclass
from typing import Sequence

from .accuracy import linked_copy, model_config
from .variants import Variant

# ModelOpt's layout of an uncalibrated skip-softmax config (its preset picks the threshold).
UNCALIBRATED = {"config_groups": {"group_0": {"algorithm": "skip_softmax"}}}


@dataclass(frozen=True)
class Peer:
    worker_cls: str  # MODULE.CLASS, imported by the server
    pythonpath: str  # folders (os.pathsep-separated) holding the worker's module and the peer's package
    sparse_attention_config: dict

    def model_dir(self, model_dir: str | os.PathLike, workdir: str | os.PathLike) -> pathlib.Path:
        """The folder the peer serves: links to ``model_dir``'s files, and its ``config.json``
        (a YaRN copy's rope scaling included) with ``sparse_attention_config`` added."""
        cfg = model_config(model_dir)
        cfg["sparse_attention_config"] = self.sparse_attention_config
        return linked_copy(model_dir, pathlib.Path(workdir) / f"{pathlib.Path(model_dir).name}-peer", cfg)

    def env(self) -> dict[str, str]:
        """The server's PYTHONPATH: the peer's folders, then the caller's."""
        return {"PYTHONPATH": os.pathsep.join(p for p in (self.pythonpath, os.environ.get("PYTHONPATH")) if p)}


def read_sparse_attention_config(path: str | os.PathLike) -> dict:
    """The ``sparse_attention_config`` in ``path``: that object, or a ``config.json`` holding it
    (what ModelOpt's export writes). Raises ValueError naming the file and what it lacks."""
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--peer-sparse-config {path}: {e}") from None
    if isinstance(data, dict):
        data = data.get("sparse_attention_config", data)
    groups = data.get("config_groups") if isinstance(data, dict) else None
    if not (isinstance(groups, dict) and groups
            and all(isinstance(g, dict) and g.get("algorithm") for g in groups.values())):
        raise ValueError(f"--peer-sparse-config {path}: needs a 'config_groups' object whose groups each "
                         f"name an 'algorithm' (ModelOpt's sparse_attention_config), e.g. {json.dumps(UNCALIBRATED)}")
    return data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--peer-worker-cls, --peer-pythonpath and --peer-sparse-config, read by :func:`from_arguments`."""
    parser.add_argument("--peer-worker-cls", metavar="MODULE.CLASS",
                        help="the vLLM worker (--worker-cls) of the LABEL=peer variants, e.g. "
                             "modelopt_worker.ModelOptSparseWorker")
    parser.add_argument("--peer-pythonpath", default="", metavar="DIR[:DIR...]",
                        help="where the peer's server imports its worker and package from (before PYTHONPATH)")
    parser.add_argument("--peer-sparse-config", metavar="JSON",
                        help="ModelOpt's sparse_attention_config, or the config.json its calibration exported, "
                             f"for the peer's copy of the model (default: uncalibrated, {json.dumps(UNCALIBRATED)})")


def from_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, variants: Sequence[Variant],
                   cuda: bool) -> Peer | None:
    """The peer of the run's ``LABEL=peer`` variants (None without one); a missing worker, a bad
    config file or a CPU run ends the program with the parser's usage error."""
    label = next((v.label for v in variants if v.peer), None)
    if label is None:
        return None
    if not args.peer_worker_cls:
        parser.error(f"variant {label!r} is a peer: --peer-worker-cls MODULE.CLASS names its vLLM worker "
                     "(and --peer-pythonpath where the server imports it from)")
    if not cuda:
        parser.error(f"variant {label!r} is a peer: it runs on CUDA only (vLLM's FLASH_ATTN)")
    try:
        config = read_sparse_attention_config(args.peer_sparse_config) if args.peer_sparse_config else UNCALIBRATED
    except ValueError as e:
        parser.error(str(e))
    return Peer(args.peer_worker_cls, args.peer_pythonpath, config)
