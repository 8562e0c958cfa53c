"""YaRN rope scaling for the evaluation tools: one spelling of the parameters, used by the
accuracy harness (a model folder whose ``config.json`` asks for it, served by vLLM) and by the
attention check (a transformers config changed in memory)."""

from __future__ import annotations

from typing import Any, Mapping


def yarn_parameters(rope: Mapping[str, Any] | None, rope_theta: float | None, max_position_embeddings: int,
                    factor: float, original: int | None = None) -> dict[str, Any]:
    """YaRN parameters over a model's trained context (``original``, default its
    ``max_position_embeddings``; Qwen2.5's recipe beyond 32K: ``factor`` 4 over 32768), keeping
    its rope theta (``rope_theta`` of its rope parameters, else the top-level one)."""
    if factor < 1:
        raise ValueError(f"yarn factor {factor}: must be >= 1")
    theta = (rope or {}).get("rope_theta", rope_theta)
    params = {"rope_type": "yarn", "factor": float(factor),
              "original_max_position_embeddings": int(original or max_position_embeddings)}
    if theta is not None:
        params["rope_theta"] = float(theta)
    return params


def scaled_max_positions(params: Mapping[str, Any], max_position_embeddings: int) -> int:
    """``max_position_embeddings`` as transformers (and vLLM 0.32) expect it with YaRN: factor x
    the original context (vLLM 0.26 derives the same from the factor)."""
    return max(int(max_position_embeddings), int(params["original_max_position_embeddings"] * params["factor"]))
