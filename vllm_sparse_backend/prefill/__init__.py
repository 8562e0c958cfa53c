"""Sparse prefill, one module per arrow of the data flow: :mod:`.plan` (which rows of a step run
sparse) -> :mod:`.estimate` (each row's index, through the pattern registry :mod:`.patterns`,
with the budgets of :mod:`.budgets`) -> the kernel (:mod:`vllm_sparse_backend.kernels`) ->
vLLM's output, driven by :mod:`.run`. The index format helpers are in :mod:`.index`."""
