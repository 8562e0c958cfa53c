"""Offline tools around the backend: nothing a vLLM server runs.

* :mod:`.assets`: the demo and test assets (models from GGUF files in PyPI wheels, long
  public-domain text from Debian and PyPI packages) and the ``convert-gguf`` command.
* :mod:`.demo`: the passkey demo through a real ``vllm serve`` (``make demo``), and the helpers
  that start and stop such servers for tests and benchmarks.
* :mod:`.search`: the offline kernel-aware pattern search (``vllm-sparse search-patterns``).
* :mod:`.evaluation`: accuracy runs and attention checks on real models.
* :mod:`.cli`: the ``vllm-sparse`` subcommands above (``search-patterns``, ``demo``).

Tools import the serving core; the core never imports tools (``tests/test_layout.py`` checks
both directions), so a server never loads this package or its dependencies.
"""
