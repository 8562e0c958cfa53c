"""vllm-sparse-backend: sparse prefill attention for vLLM, as a plugin.

Entry point (group ``vllm.general_plugins``): :func:`register`. Select the backend with
``vllm serve MODEL --attention-backend sparse-prefill``.
"""

__version__ = "0.1.0"


def register() -> None:
    """vLLM general-plugin entry point; runs in every vLLM process. Cheap and idempotent.

    Also checks the ``VLLM_SPARSE_*`` settings and the head-config file they name, so that a
    bad value stops ``vllm serve`` before the model loads (:mod:`vllm_sparse_backend.startup`)."""
    from ._compat import register_backends
    from .startup import check_at_registration

    register_backends()
    check_at_registration()
