"""What the sparse backend keeps for the life of one worker process, in one object.

vLLM builds a metadata builder per KV-cache group and an attention impl per layer and hands
neither anything of ours, so each asks :func:`worker_runtime` for its process's
:class:`WorkerRuntime`. The first ask happens in the worker while vLLM builds the model's
attention layers (tensor parallelism is set up by then). There, once per process:

* the settings are read from the environment and validated (a bad value fails at start-up,
  naming the variable and field), and so is the head-config file they name;
* the stats are configured and the Prometheus metrics made, held here, and served on
  ``metrics_port`` if set (under tensor parallelism only rank 0 records, makes and serves them);
* each layer's head patterns are resolved, on first use, and kept for the builder and the impl.

It also remembers what was logged once, how the profiling-run scratch claim went, and the memory
the profiling run claimed for the decode modes' state.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from .config import ConfigError
from .settings import SparseSettings
from .decode.memory import DecodeStateMemory
from .head_configs import HeadConfigFile, check_fits_hf_config, resolve_head_config
from .prefill.plan import RankHeads
from .startup import load_checked_settings, report_startup_error
from .observability import metrics
from .observability.stats import SparseStats

if TYPE_CHECKING:
    from .backends.host_kv import HostKV

logger = logging.getLogger("vllm.sparse_prefill")
LOG_ONCE_MEMORY = 256  # distinct texts log_once remembers


class WorkerRuntime:
    """One worker process's settings, stats and per-layer state (see the module doc)."""

    def __init__(self, settings: SparseSettings, tp_rank: int = 0):
        self.settings = settings
        self.head_config: HeadConfigFile | None = (
            resolve_head_config(settings.head_config) if settings.head_config else None)
        export = tp_rank == 0
        # made at start-up, so that they exist (at 0) before the first long request
        self.metrics = metrics.create_metrics() if export else metrics.NO_METRICS
        self.stats = SparseStats(_prom=self.metrics)
        self.stats.configure(settings.observability, export=export)
        obs = settings.observability
        self.metrics_served = export and obs.metrics_port is not None \
            and metrics.serve_metrics(obs.metrics_port, obs.metrics_host)
        # why the profiling run of the sparse path failed in this process (every group then runs
        # dense: sparse rows would use memory the KV cache was sized without), or None
        self.claim_failed: str | None = None
        self.claimed: set = set()  # claim signatures already run (layers of one shape share a claim)
        # decode_mode topk / spans: the memory claimed in the profiling run for every layer's state
        self.decode_memory = DecodeStateMemory()
        # kv_placement=host: the one host placement of every layer (backends/host_kv.py), made by the
        # first layer that writes K/V
        self.host_kv: HostKV | None = None
        # layer name -> that layer's head patterns on this rank, resolved once (backends.common.layer_heads):
        # the builder plans with them, the layer's impl runs them
        self.layer_heads: dict[str, RankHeads] = {}
        self._logged: OrderedDict[str, None] = OrderedDict()  # the texts log_once printed, least recent first
        self._fitted_models: set[str] = set()

    def log_once(self, msg: str, *args, info: bool = False) -> None:
        """A warning (``info``: an information line) that this process prints once per distinct text."""
        key = msg % args if args else msg
        if key in self._logged:
            self._logged.move_to_end(key)
            return
        self._logged[key] = None
        if len(self._logged) > LOG_ONCE_MEMORY:  # texts with a varying part (an error's) must not grow it forever
            self._logged.popitem(last=False)  # the least recently logged: it may log again
        logger.log(logging.INFO if info else logging.WARNING, "sparse-prefill: " + msg, *args)

    def check_head_config_fits(self, hf_text_config: dict, model: str) -> None:
        """The head-config file must have the model's layers, heads and KV-group layout
        (ConfigError naming the file and field otherwise); checked once per model."""
        if self.head_config is None or model in self._fitted_models:
            return
        try:
            check_fits_hf_config(self.head_config, hf_text_config, model, self.settings.head_config)
        except ConfigError as e:
            report_startup_error(e)  # so that the plugin's `vllm` command ends with it (startup.py)
            raise
        self._fitted_models.add(model)


@functools.cache
def worker_runtime() -> WorkerRuntime:
    """This process's runtime, made on the first call (in a vLLM worker: see the module doc)."""
    from ._compat import tensor_parallel_rank

    return WorkerRuntime(load_checked_settings(), tensor_parallel_rank())
