"""The Triton kernels of vllm-sparse-backend, an importable package of their own
(``vllm_sparse_kernels``; the name is chosen so that it can never be mistaken for the unrelated
top-level ``triton_kernels`` package that vLLM imports).

The bottom layer: it depends on torch and triton only and never imports ``vllm_sparse_backend``
(or vLLM). Layout:

- top level: what both sides share: the sparse index format (:mod:`.index_format`), the
  kernels' named constants (:mod:`.constants`), fp8 KV-cache scales (:mod:`.kv_quant`), the
  radix top-k (:mod:`.topk_select`), the KV head map and paged-cache gathers
  (:mod:`.kv_layout`) and the PyTorch sparse attention of the CPU path (:mod:`.torch_attention`);
- :mod:`.prefill`: the sparse prefill attention kernel and the GPU index estimators;
- :mod:`.decode`: the decode-side top-k and span-retrieval kernels;
- :mod:`.reference`: the plain torch oracles the tests compare against (tests only).

Torch only, no triton: :mod:`.index_format`, :mod:`.kv_quant`, :mod:`.kv_layout`,
:mod:`.torch_attention`, :mod:`.prefill.estimate_math`,
:mod:`.prefill.launch_config` and everything in :mod:`.reference`; every other module imports
triton. Importing this package or its subpackages imports neither, so CPU installs without
triton can use the torch-only modules; ``vllm_sparse_backend.kernels`` is the one place that
imports the Triton modules, where triton is available.
"""
