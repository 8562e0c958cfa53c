"""Plain torch oracles of the kernels (float64 where it matters, loops where they are clearer):
what the tests compare against, and nothing else: no serving module imports them (the CPU
serving path's attention is :mod:`vllm_sparse_kernels.torch_attention`).

Torch only (they import without triton). Importing this package imports nothing.
"""
