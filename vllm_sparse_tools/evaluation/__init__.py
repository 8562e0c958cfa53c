"""Does sparse prefill keep a real model's answers? Tools to measure it.

* :mod:`.tasks`: synthetic long-context tasks (needles, variable tracking, common words) cut
  from offline public-domain text with fixed seeds, and their scoring.
* :mod:`.variants`: named sparse configurations (``vs``, ``flex0.9``, ...) shared by the
  accuracy runs (as ``VLLM_SPARSE_*`` variables) and the attention check (as settings).
* :mod:`.accuracy`: the same prompts through vLLM servers, dense and sparse, scored side by side.
* :mod:`.attention_check`: Q/K/V captured from a real model's layers; per layer and pattern the
  softmax mass the sparse selection covers (recall) and the output error against dense.
* :mod:`.inputs`: the benchmarks' names for models, texts and variants, resolved to cached assets.
* :mod:`.peers`: another project's sparse attention served beside ours (a worker class).
* :mod:`.host_kv`: a kv_placement=host variant's server before a GPU has run the mode (``--unverified-host-kv``).

Nothing here is imported by the serving package (see :mod:`vllm_sparse_tools`).
"""
