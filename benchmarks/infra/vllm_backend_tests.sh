#!/usr/bin/env bash
# vLLM's own attention-backend correctness tests (tests/v1/attention/test_attention_backends.py of
# vLLM's source, test_causal_backend_correctness: each backend against a FlexAttention reference
# over decode, prefill and mixed batches, 3 KV-cache dtypes, head counts of TP 1 / 2 / 4) with this
# backend registered and put among the backends by benchmarks/infra/vllm_suite_plugin.py. The
# suite runs from vLLM's source tree; nothing of it is copied into this repository.
#
#   bash benchmarks/infra/vllm_backend_tests.sh density1 [PYTEST ARGS...]
#       this backend alone, the sparse path forced onto every row of 8+ query tokens with budgets
#       covering every key (max_density 1): rows must match the reference within the suite's own
#       tolerance, and the session fails unless rows ran sparse without the sparse path raising
#   bash benchmarks/infra/vllm_backend_tests.sh default [PYTEST ARGS...]
#       the default settings, this backend alone: every row of the suite is shorter than
#       min_sparse_query_len, so each row runs on FlashAttention and must match the reference
#   bash benchmarks/infra/vllm_backend_tests.sh beside [PYTEST ARGS...]
#       the default settings, this backend beside vLLM's (FLASH_ATTN, FLASHINFER, FLEX_ATTENTION,
#       TRITON_ATTN): it must pass exactly where FLASH_ATTN does (five backends a case: about 16 s
#       a case on an H200, 24 minutes for the 90; split it with -k)
#   bash benchmarks/infra/vllm_backend_tests.sh collect
#       collection only (works on a CPU against vLLM 0.33's Python files)
#
# On the GPU machine after `benchmarks/infra/gpu_user_stack.sh install` (which puts vLLM's test
# tree in /tmp/vllm-src). Results: $RESULTS (default $OUT where set, else /tmp/vllm-suite) gets
# vllm_suite_<mode>.xml (JUnit) and .log. Environment: VLLM_SRC (/tmp/vllm-src/vllm-0.33.0),
# RESULTS, PYTHON (python3), STACK (benchmarks/infra/gpu_user_stack.sh; empty: run python as is).
#
# The suite builds its configs from the Hugging Face name Qwen/Qwen3-0.6B; the GPU machine has no
# network, so the script writes that model's config.json (no weights: the tests use only its
# attention geometry, 16 query / 8 KV heads of 128, bf16) and points vLLM's own
# VLLM_MODEL_REDIRECT_PATH at it.
set -euo pipefail

mode=${1:-}
case $mode in
  density1 | default | beside | collect) shift ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac
[ -f vllm_sparse_backend/__init__.py ] || { echo "run from the repository root" >&2; exit 2; }
VLLM_SRC=${VLLM_SRC:-/tmp/vllm-src/vllm-0.33.0}
SUITE=$VLLM_SRC/tests/v1/attention/test_attention_backends.py
[ -f "$SUITE" ] || { echo "$SUITE missing: set VLLM_SRC to vLLM's source (gpu_user_stack.sh install unpacks it)" >&2; exit 2; }
RESULTS=${RESULTS:-${OUT:-/tmp/vllm-suite}}
mkdir -p "$RESULTS"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mkdir -p "$work/Qwen3-0.6B"
cat > "$work/Qwen3-0.6B/config.json" <<'EOF'
{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": false,
 "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
 "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
 "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16,
 "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": null,
 "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
 "use_cache": true, "use_sliding_window": false, "vocab_size": 151936}
EOF
printf '{"Qwen/Qwen3-0.6B": "%s"}\n' "$work/Qwen3-0.6B" > "$work/redirect.json"

# settings start from the defaults: none inherited from the caller
for v in $(env | sed -n 's/^\(VLLM_SPARSE_[A-Z0-9_]*\)=.*/\1/p'); do unset "$v"; done
args=(-p benchmarks.infra.vllm_suite_plugin -p no:cacheprovider --rootdir "$VLLM_SRC"
      -c "$VLLM_SRC/pyproject.toml" "$SUITE" -k test_causal_backend_correctness)
case $mode in
  density1)
    export VLLM_SPARSE_MAX_DENSITY=1 VLLM_SPARSE_VERTICAL_SIZE=65536 VLLM_SPARSE_SLASH_SIZE=65536 \
      VLLM_SPARSE_MIN_SPARSE_QUERY_LEN=8
    args+=(--sparse-backend-mode only --sparse-backend-require-sparse) ;;
  default) args+=(--sparse-backend-mode only) ;;
  beside) args+=(--sparse-backend-mode add) ;;
  collect) args+=(--collect-only -q) ;;
esac
[ "$mode" = collect ] || args+=(-q -rfEs "--junitxml=$RESULTS/vllm_suite_$mode.xml")

export VLLM_MODEL_REDIRECT_PATH=$work/redirect.json HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
runner=(${PYTHON:-python3} -m pytest)
stack=${STACK-benchmarks/infra/gpu_user_stack.sh}
[ -n "$stack" ] && runner=(bash "$stack" run "${runner[@]}")
echo "vLLM suite, $mode: $SUITE"
set +e
"${runner[@]}" "${args[@]}" "$@" 2>&1 | tee "$RESULTS/vllm_suite_$mode.log"
status=${PIPESTATUS[0]}
set -e
echo "exit status $status; results in $RESULTS/vllm_suite_$mode.{log,xml}"
exit "$status"
