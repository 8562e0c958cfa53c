"""Offline tools around the sparse-prefill backend: nothing a vLLM server runs.

* :mod:`.assets`: the demo and test assets (models from GGUF files in PyPI wheels, long
  public-domain text from Debian and PyPI packages) and the ``convert-gguf`` command.
* :mod:`.demo`: the passkey demo through a real ``vllm serve`` (``make demo``), and the helpers
  that start and stop such servers for tests and benchmarks.
* :mod:`.search`: the offline kernel-aware pattern search (``vllm-sparse search-patterns``).
* :mod:`.layer_budgets`: per-layer budgets from a recall run (``vllm-sparse layer-budgets``).
* :mod:`.evaluation`: accuracy runs and attention checks on real models.
* :mod:`.cli`: the ``vllm-sparse`` command, every subcommand.

A package of its own, beside the serving package ``vllm_sparse_backend``: the tools import the
serving package, never the reverse (``tests/unit/test_layout.py``), so a server loads neither this
package nor what it needs (the ``tools`` extra: transformers, gguf, accelerate).
"""
