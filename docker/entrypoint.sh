#!/usr/bin/env bash
# Entrypoint of the vllm-sparse-backend image. Runs (exec, so signals reach the server)
#
#   vllm serve MODEL [--revision $MODEL_REVISION] --host $HOST --port $PORT \
#       --attention-backend sparse-prefill [$VLLM_EXTRA_ARGS] [the container's arguments after the model]
#
# MODEL comes from the first argument when that is not a flag, else from $MODEL. Flags given to
# the container come last, so they override the defaults above (argparse keeps the last value).
# VLLM_EXTRA_ARGS is split like a shell would split it (quotes respected, nothing expanded).
# Before starting: stale metric files in $PROMETHEUS_MULTIPROC_DIR are removed, and
# sparse_prefill is added to $VLLM_PLUGINS when that variable filters plugins. With VLLM_API_KEY
# set, --middleware vllm_sparse_backend.serving_auth.RequireApiKey closes every route but /health
# to requests without the key (vLLM's own check leaves /invocations, /tokenize, /metrics... open).
# The command is logged with the value of any --api-key masked (VLLM_API_KEY is never printed).
#
#   vllm-sparse-entrypoint --healthcheck   exit 0 if http://127.0.0.1:$PORT/health answers 200
set -euo pipefail

PYTHON="${PYTHON:-python3}"
HOST="${HOST:-0.0.0.0}"
PORT="${PORT:-8000}"

die() {
  echo "vllm-sparse-entrypoint: $*" >&2
  exit 2
}

if ! [[ "$PORT" =~ ^[0-9]{1,5}$ ]] || ((10#$PORT < 1 || 10#$PORT > 65535)); then
  die "PORT='$PORT' is not a TCP port (1-65535)"
fi

if [[ "${1:-}" == "--healthcheck" ]]; then
  exec "$PYTHON" - "$PORT" <<'PY'
import sys
import urllib.request

try:
    with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=8) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception as e:  # refused, timeout, HTTP error status
    print(f"unhealthy: {e}", file=sys.stderr)
    sys.exit(1)
PY
fi

model="${MODEL:-}"
if [[ $# -gt 0 && "$1" != -* ]]; then
  model="$1"
  shift
fi
[[ -n "$model" ]] || die "no model: set MODEL, or pass it as the first argument (IMAGE org/model [vllm serve flags])"

extra=()
if [[ -n "${VLLM_EXTRA_ARGS:-}" ]]; then
  split='import os, shlex, sys; sys.stdout.write("".join(a + "\0" for a in shlex.split(os.environ["VLLM_EXTRA_ARGS"])))'
  err="$("$PYTHON" -c "$split" 2>&1 >/dev/null)" || die "VLLM_EXTRA_ARGS cannot be split: ${err##*: }"
  mapfile -d '' -t extra < <("$PYTHON" -c "$split")
fi

if [[ -n "${PROMETHEUS_MULTIPROC_DIR:-}" ]]; then
  mkdir -p "$PROMETHEUS_MULTIPROC_DIR" 2>/dev/null \
    || die "PROMETHEUS_MULTIPROC_DIR=$PROMETHEUS_MULTIPROC_DIR cannot be created"
  [[ -w "$PROMETHEUS_MULTIPROC_DIR" ]] || die "PROMETHEUS_MULTIPROC_DIR=$PROMETHEUS_MULTIPROC_DIR is not writable by uid $(id -u)"
  # Files of a previous run (a restarted container keeps its emptyDir) would be counted again.
  find "$PROMETHEUS_MULTIPROC_DIR" -maxdepth 1 -type f -name '*.db' -delete
fi

if [[ -n "${VLLM_PLUGINS:-}" && ",${VLLM_PLUGINS// /}," != *",sparse_prefill,"* ]]; then
  export VLLM_PLUGINS="${VLLM_PLUGINS},sparse_prefill"
  echo "vllm-sparse-entrypoint: VLLM_PLUGINS filters plugins; added sparse_prefill: $VLLM_PLUGINS" >&2
fi

revision=()
if [[ -n "${MODEL_REVISION:-}" ]]; then
  revision=(--revision "$MODEL_REVISION")
fi

auth=()
if [[ -n "${VLLM_API_KEY:-}" ]]; then
  auth=(--middleware vllm_sparse_backend.serving_auth.RequireApiKey)
fi

cmd=(vllm serve "$model" "${revision[@]}" --host "$HOST" --port "$PORT" --attention-backend sparse-prefill
     "${auth[@]}" "${extra[@]}" "$@")
shown=()
mask_next=0
for arg in "${cmd[@]}"; do
  if ((mask_next)); then
    shown+=("***")
    mask_next=0
  elif [[ "$arg" == --api-key ]]; then
    shown+=("$arg")
    mask_next=1
  elif [[ "$arg" == --api-key=* ]]; then
    shown+=("--api-key=***")
  else
    shown+=("$arg")
  fi
done
echo "vllm-sparse-entrypoint: exec ${shown[*]}" >&2
exec "${cmd[@]}"
