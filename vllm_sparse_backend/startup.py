"""Start-up checks run by the plugin entry point, in every vLLM process, before any model loads.

vLLM calls the general plugin's ``register()`` in the API server while it builds its argument
parser (before the engine, the model load, the compile and the profiling run), then again in
the engine-core and worker processes. Checking the settings and the head-config file there
turns a bad value into an error within seconds of ``vllm serve`` instead of after the model
has loaded.

The model's shape is not known yet at that point, and vLLM offers a general plugin no later call
in the API server (it builds the engine config, with the model's Hugging Face config, and starts
the engine with no hook in between). So the worker checks the head-config file against the model
when it builds the attention layers (``runtime.WorkerRuntime.check_head_config_fits``). Under the
plugin's ``vllm`` command (:mod:`vllm_sparse_backend.vllm_cli`, what ``make venv`` installs on
CPU) two more things happen:

* before vLLM is even imported, when ``vllm serve`` names a local model folder and selects the
  backend, the command checks the head-config file against the folder's ``config.json``
  (:func:`check_model_folder`): a file made for another model ends the command within a second,
  exit status 2, the cause as the last lines;
* for the models that check cannot see (hub names, configs rewritten by ``--hf-overrides``), the
  worker writes the cause to a report file the command named in :data:`STARTUP_REPORT_ENV`; when
  vLLM's start-up then fails, the command prints the cause as its last lines and exits with
  status 2, as for any other bad setting (vLLM's own logs of the failure come before it).

vLLM runs ``register()`` without catching its exceptions: an exception raised in the API server
ends ``vllm serve`` with a traceback of vLLM's parser set-up. Inside vLLM's command line the
check prints the error alone, one line per problem, and exits with status 2; elsewhere (vLLM's
Python API, the engine and worker processes) it raises :class:`ConfigError`.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sys
from typing import Mapping

from .config import ENV_PREFIX, ConfigError, NameCheck
from .settings import SparseSettings, load_settings
from .decode import check_decode_mode_name
from .head_configs import HeadConfigFile, HeadConfigMisfit, check_fits_hf_config, resolve_head_config
from .kv_placement import check_kv_placement_name
from .prefill.patterns import check_pattern_name

logger = logging.getLogger("vllm.sparse_prefill")

# Importing this module means the process runs vLLM's command line (`vllm serve ...`).
_VLLM_CLI_MODULE = "vllm.entrypoints.cli.main"
EXIT_STATUS = 2
# Where a vLLM process started by the plugin's `vllm` command leaves a start-up error that only
# the worker can find (the path is set by that command, inherited by the engine and worker
# processes). Not a VLLM_* name: vLLM would warn about it as an unknown variable.
STARTUP_REPORT_ENV = "SPARSE_PREFILL_STARTUP_REPORT"


def name_checks() -> dict[str, NameCheck]:
    """The settings fields that name a registered thing, each with its registry's check."""
    return {"default_pattern": check_pattern_name, "decode_mode": check_decode_mode_name,
            "kv_placement": check_kv_placement_name}


def load_checked_settings(env: Mapping[str, str] | None = None) -> SparseSettings:
    """:func:`~.settings.load_settings` with the names checked by their registries: what serving,
    the worker and the command line use."""
    return load_settings(env, name_checks())


def check_settings(env: Mapping[str, str] | None = None) -> tuple[SparseSettings, HeadConfigFile | None]:
    """The settings and the head-config file they name, validated (ConfigError naming the
    variable or file and the field otherwise)."""
    settings = load_checked_settings(env)
    head_config = resolve_head_config(settings.head_config) if settings.head_config else None
    if settings.observability.stats_file:
        check_stats_file(settings.observability.stats_file)
    return settings, head_config


def check_model_folder(model_dir: str, env: Mapping[str, str] | None = None) -> None:
    """The settings (:func:`check_settings`) and, when they name a head-config file, its fit to
    the model folder's ``config.json`` (ConfigError naming the file and field otherwise), with the
    worker's own check and wording (``head_configs.check_fits_hf_config``).

    A folder without a readable ``config.json`` that states the layer and head counts plainly
    (a multimodal config leaving them to the model class's defaults, say) passes: the worker
    checks the config vLLM builds from it."""
    settings, head_config = check_settings(env)
    if head_config is None:
        return
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            hf_config = json.load(f)
    except (OSError, ValueError):
        return
    if not isinstance(hf_config, dict):
        return
    try:
        check_fits_hf_config(head_config, hf_config, model_dir, settings.head_config)
    except HeadConfigMisfit:
        raise
    except ConfigError:
        return  # the shape is not plain in config.json: left to the worker


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
        print_error(str(e))
        raise SystemExit(EXIT_STATUS) from None
    if multiprocessing.parent_process() is None:
        # The launching process is the one where vLLM checks the environment against its own
        # list of variables (EngineArgs.create_engine_config -> validate_environ). A warning,
        # like the plugin's other start-up lines: vLLM's CLI sets up its logging only after
        # parsing the arguments, and until then Python prints warnings alone, not info lines.
        logger.warning("sparse-prefill: %d VLLM_SPARSE_* variable(s) checked and valid; vLLM will still call "
                    "each an 'Unknown vLLM environment variable' (it has no way for a plugin to declare its "
                    "variables)", len(ours))


def print_error(message: str) -> None:
    """The error as vLLM's command line prints a bad argument: alone, one line per problem."""
    for line in message.splitlines():
        print(f"vllm-sparse-backend: error: {line}", file=sys.stderr)
    sys.stderr.flush()


def report_startup_error(error: ConfigError) -> None:
    """Leave ``error`` for the plugin's ``vllm`` command, if it started this process (a no-op
    otherwise); the caller raises it as before."""
    path = os.environ.get(STARTUP_REPORT_ENV)
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(str(error))
    except OSError:  # the command's folder is gone: vLLM's own logs still carry the error
        pass


def read_startup_report(path: str) -> str | None:
    """The error a vLLM process left at ``path`` (:func:`report_startup_error`), or None."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None
