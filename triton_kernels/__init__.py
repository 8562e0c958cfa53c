"""Triton kernels of vllm-sparse-backend, installed as ``vllm_sparse_backend.triton_kernels``.

(Never a top-level ``triton_kernels`` module: vLLM imports an unrelated package of that name.)
Kernels import nothing from vLLM. Importing this package does not import triton; the kernel
modules do, and are only imported on CUDA machines.
"""
