"""The Triton kernels of vllm-sparse-backend, an importable package of their own
(``sparse_prefill_kernels``; the name is chosen so that it can never be mistaken for the unrelated
top-level ``triton_kernels`` package that vLLM imports).

The bottom layer: it depends on torch and triton only and never imports ``vllm_sparse_backend``
(or vLLM). It owns what the kernels consume: the sparse index format (:mod:`.index_format`) and
the score arithmetic its estimators share with the package's torch estimators
(:mod:`.estimate_math`). Those two modules need torch only; every other module imports triton.
Importing this package itself imports neither, so CPU installs without triton can use the format;
``vllm_sparse_backend.kernels`` is the one place that imports the Triton modules, where triton is
available.
"""
