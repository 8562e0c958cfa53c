"""Plain torch oracles of the kernels (float64 where it matters, loops where they are clearer):
what the kernel tests compare against, and the CPU serving path's attention
(:func:`.attention.sparse_attention`).

Torch only: CPU installs without triton import these modules. Importing this package imports
nothing.
"""
