#!/usr/bin/env bash
# FlashAttention-4's CuTe DSL kernels, as vLLM 0.33 ships them (vllm/vllm_flash_attn/cute), for
# benchmarks/studies/library_tiles.py on a GPU machine of the device tool: vLLM 0.33 requires
# nvidia-cutlass-dsl[cu13] 4.8.0 and quack-kernels 0.6.5, which gpu_user_stack.sh's lean tier does
# not carry (the engine itself does not import them on Hopper). Six wheels, 96 MiB, three chunks of at
# most 40 MiB (a device call carries 64 MiB with the working tree: a 59 MiB chunk did not fit).
#
#   here, from the repository root:  bash benchmarks/infra/gpu_fa4.sh prepare
#       downloads the wheels and packs them into .gpu/fa4/m0, m1, m2 (pack_model --files)
#   there, one call per chunk K (carry [".gpu/fa4/mK"]):  bash benchmarks/infra/gpu_fa4.sh stage K
#   there, after gpu_user_stack.sh install:              bash benchmarks/infra/gpu_fa4.sh install
#       installs them beside vLLM (/tmp/site-user-vllm) and imports FA4's interface
#
# nvidia-cutlass-dsl's CUDA 12 libraries (a dependency it always names) are left out: torch 2.14
# is built for CUDA 13 and takes the cu13 ones.
set -euo pipefail
SITE_VLLM=${SITE_VLLM:-/tmp/site-user-vllm}
STAGE=${STAGE:-/tmp/mstage-fa4}
WHEELS=(nvidia-cutlass-dsl==4.8.0 nvidia-cutlass-dsl-libs-base==4.8.0 nvidia-cutlass-dsl-libs-cu13==4.8.0
        quack-kernels==0.6.5 einops==0.8.2 torch-c-dlpack-ext==0.1.5)

case "${1:-}" in
  prepare)
    root="$(git rev-parse --show-toplevel)"
    cd "$root"
    exclude="$(git rev-parse --git-common-dir)/info/exclude"
    grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform any -d "$tmp" "${WHEELS[@]}"
    rm -rf .gpu/fa4
    python3 -m benchmarks.infra.pack_model pack --files "$tmp"/*.whl --out .gpu/fa4 --chunk-mib 40
    rm -rf "$tmp"
    ;;
  stage)
    mkdir -p "$STAGE"
    cp -n .gpu/fa4/m"${2:?chunk number}"/* "$STAGE"/
    echo "staged: $(ls "$STAGE" | wc -l) files"
    ;;
  install)
    rm -rf /tmp/fa4-wheels
    python3 -m benchmarks.infra.pack_model unpack /tmp/fa4-wheels --stage "$STAGE" | tail -1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE_VLLM" \
      /tmp/fa4-wheels/*.whl 2>&1 | grep -v "already exists" | tail -3 || true
    eval "$(bash benchmarks/infra/gpu_user_stack.sh env)"
    python3 -c "import cutlass, quack; from vllm.vllm_flash_attn.cute import interface; print('FA4 (CuTe DSL) importable')"
    ;;
  *)
    echo "usage: $0 prepare|stage K|install" >&2
    exit 2
    ;;
esac
