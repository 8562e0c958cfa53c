#!/usr/bin/env bash
# Stage a real model on the GPU machine (no network there) from GGUF chunks made here with
# benchmarks/infra/pack_model.py, and convert it there to a bf16 Hugging Face folder.
#
# Here (git-ignored chunk folders; a GGUF travels in fewer chunks than the packed bf16 folder:
# Qwen2.5-Coder-1.5B 19 instead of 42, 0.5B 9 instead of 15):
#   python -m benchmarks.infra.pack_model pack --files qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
#       --extra gguf-0.19.0-py3-none-any.whl austen.txt --out .gpu/m15b --chunk-mib 52   # m0 .. m21
# (a device call carries the working tree too, about 10 MB now, within 64 MiB; vLLM's staged
# wheels may ride in the same chunks as further --files: 28 chunks for both on 2026-11-26)
# On the GPU machine, one device call per chunk K, back to back (carry [".gpu/m15b/mK"]):
#   mkdir -p /tmp/mstage-m15b && cp -n .gpu/m15b/mK/* /tmp/mstage-m15b/
# then once, from the repository root:
#   bash benchmarks/infra/gpu_stage_model.sh m15b       # or m05b; qwen-coder-1.5b / qwen-coder too
#
# Steps, each skipped when already done (so a second run costs about the GGUF's sha256):
#   1. unpack /tmp/mstage-NAME into /tmp/mstage-NAME/unpacked (sha256 of every file checked);
#   2. install the carried gguf wheel into /tmp/site-gguf (the GPU image has no gguf; its
#      other needs, numpy, pyyaml, requests and tqdm, are there);
#   3. convert the GGUF to /tmp/models/<folder> with
#      `python3 -m vllm_sparse_tools.assets convert-gguf` (the same code path as the asset
#      cache, sha256 checked against the digest recorded in vllm_sparse_tools/assets.py);
#   4. copy austen.txt to /tmp/austen.txt.
# Prints the model folder on the last line. Environment overrides: STAGE, GGUF_SITE,
# MODELS_DIR, TEXT_OUT (/tmp/austen.txt), PYTHON.
set -euo pipefail

usage="usage: $0 NAME   (m15b or qwen-coder-1.5b; m05b or qwen-coder)"
name=${1:?$usage}
case $name in
  m15b | qwen-coder-1.5b) name=m15b ;;
  m05b | qwen-coder) name=m05b ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
[ -f vllm_sparse_tools/assets.py ] || { echo "run from the repository root" >&2; exit 2; }

stage=${STAGE:-/tmp/mstage-$name}
unpacked=$stage/unpacked
site=${GGUF_SITE:-/tmp/site-gguf}
models=${MODELS_DIR:-/tmp/models}
text_out=${TEXT_OUT:-/tmp/austen.txt}
py=${PYTHON:-python3}
t_start=$(date +%s.%N)
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# 1. unpack
if [ -f "$unpacked/.unpacked" ]; then
  echo "[1/4] unpack: already done ($unpacked)"
else
  t=$(date +%s.%N)
  "$py" -m benchmarks.infra.pack_model unpack "$unpacked" --stage "$stage"
  touch "$unpacked/.unpacked"
  echo "[1/4] unpack: $(since "$t") s"
fi

shopt -s nullglob
ggufs=("$unpacked"/*.gguf)
wheels=("$unpacked"/gguf-*.whl)
shopt -u nullglob
[ ${#ggufs[@]} -eq 1 ] || { echo "expected one .gguf in $unpacked, found ${#ggufs[@]}" >&2; exit 1; }
gguf=${ggufs[0]}
base=$(basename "$gguf")
folder=$models/${base%-q4_k_m.gguf}

# 2. the gguf package
if [ -f "$site/gguf/__init__.py" ]; then
  echo "[2/4] gguf: already in $site"
else
  [ ${#wheels[@]} -ge 1 ] || { echo "no gguf-*.whl in $unpacked" >&2; exit 1; }
  t=$(date +%s.%N)
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "${wheels[@]}"
  echo "[2/4] gguf: installed $(basename "${wheels[0]}") into $site in $(since "$t") s"
fi

# 3. convert (convert-gguf itself returns at once when the folder was converted from this file)
if [ -f "$folder/.asset.json" ] && [ -f "$folder/config.json" ]; then
  echo "[3/4] convert: already done ($folder)"
else
  t=$(date +%s.%N)
  # The package is imported from the repository root (python -m / -c put the working directory
  # first on sys.path). PYTHONPATH holds only the gguf site: the conversion child runs in a
  # scratch directory and inherits it, and should not see the checkout's top-level folders.
  sha=$("$py" -c 'import sys
from vllm_sparse_tools.assets import known_gguf_sha256
print(known_gguf_sha256()[sys.argv[1]])' "$base")
  PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} "$py" -m vllm_sparse_tools.assets convert-gguf \
    "$gguf" "$folder" --sha256 "$sha"
  echo "[3/4] convert: $(since "$t") s ($(du -sm "$folder" | cut -f1) MB)"
fi

# 4. the haystack text
if [ -f "$unpacked/austen.txt" ]; then
  if cmp -s "$unpacked/austen.txt" "$text_out"; then
    echo "[4/4] austen: $text_out already there"
  else
    cp "$unpacked/austen.txt" "$text_out"
    echo "[4/4] austen: copied to $text_out"
  fi
else
  echo "[4/4] austen: not in this model's chunks (skipped)"
fi

echo "staged in $(since "$t_start") s; model folder:"
echo "$folder"
