"""Start-up checks run by the plugin entry point, in every vLLM process, before any model loads.

vLLM calls the general plugin's ``register()`` in the API server while it builds its argument
parser (before the engine, the model load, the compile and the profiling run), then again in
the engine-core and worker processes. Checking the settings and the head-config file there
turns a bad value into an error within seconds of ``vllm serve`` instead of after the model
has loaded. The model's shape is not known yet at that point: the worker checks the head-config
file against it when it builds the attention layers (``backends.common``).

vLLM runs ``register()`` without catching its exceptions: an exception raised in the API server
ends ``vllm serve`` with a traceback of vLLM's parser set-up. Inside vLLM's command line the
check prints the error alone, one line per problem, and exits with status 2; elsewhere (vLLM's
Python API, the engine and worker processes) it raises :class:`ConfigError`.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from typing import Mapping

from .config import ENV_PREFIX, ConfigError, SparseSettings, load_settings
from .head_configs import HeadConfigFile, resolve_head_config

logger = logging.getLogger("vllm.sparse_prefill")

# Importing this module means the process runs vLLM's command line (`vllm serve ...`).
_VLLM_CLI_MODULE = "vllm.entrypoints.cli.main"
EXIT_STATUS = 2


def check_settings(env: Mapping[str, str] | None = None) -> tuple[SparseSettings, HeadConfigFile | None]:
    """The settings and the head-config file they name, validated (ConfigError naming the
    variable or file and the field otherwise)."""
    settings = load_settings(env)
    head_config = resolve_head_config(settings.head_config) if settings.head_config else None
    if settings.stats_file:
        check_stats_file(settings.stats_file)
    return settings, head_config


def check_stats_file(path: str) -> None:
    """The stats file's folder must exist and be writable by this process (ConfigError naming
    the variable otherwise): the worker rewrites the file while it serves."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"VLLM_SPARSE_STATS_FILE={path!r}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"VLLM_SPARSE_STATS_FILE={path!r}: folder {folder} is not writable")


def check_at_registration() -> None:
    """Validate ``VLLM_SPARSE_*`` (and the files they name) if any is set; see the module doc."""
    ours = sorted(k for k in os.environ if k.startswith(ENV_PREFIX))
    if not ours:
        return  # the defaults are valid and name no file
    try:
        check_settings(os.environ)
    except ConfigError as e:
        if _VLLM_CLI_MODULE not in sys.modules:
            raise
        for line in str(e).splitlines():
            print(f"vllm-sparse-backend: error: {line}", file=sys.stderr)
        sys.stderr.flush()
        raise SystemExit(EXIT_STATUS) from None
    if multiprocessing.parent_process() is None:
        # The launching process is the one where vLLM checks the environment against its own
        # list of variables (EngineArgs.create_engine_config -> validate_environ). A warning,
        # like the plugin's other start-up lines: vLLM's CLI sets up its logging only after
        # parsing the arguments, and until then Python prints warnings alone, not info lines.
        logger.warning("sparse-prefill: %d VLLM_SPARSE_* variable(s) checked and valid; vLLM will still call "
                    "each an 'Unknown vLLM environment variable' (it has no way for a plugin to declare its "
                    "variables)", len(ours))
