"""vLLM-facing classes: CUDA (FlashAttention subclasses) and the CPU twin (CPU_ATTN subclasses)."""
