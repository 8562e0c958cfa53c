"""Decode side of the kernels: top-k page attention (:mod:`.topk_decode`), span-retrieval page
selection (:mod:`.span_decode`) and what both read of the paged cache (:mod:`.paged_cache`).

Importing this package imports nothing; its modules import triton.
"""
