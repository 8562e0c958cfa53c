"""vllm-sparse-backend: sparse prefill attention for vLLM, as a plugin.

Entry point (group ``vllm.general_plugins``): :func:`register`. Select the backend with
``vllm serve MODEL --attention-backend sparse-prefill``.
"""

__version__ = "0.1.0"


def register() -> None:
    """vLLM general-plugin entry point; runs in every vLLM process. Cheap and idempotent."""
    from ._compat import register_backends

    register_backends()
