#!/usr/bin/env bash
# vLLM 0.33 on a GPU machine of the device tool (no network there), on the image's torch 2.11
# (issue 23; sizes and the ABI reading behind "torch 2.11 can load it" in docs/vllm-0.33-api.md).
# 0.33's Python dependencies are, as far as serving a plain decoder needs them, the 0.26 set of
# ../shared/gpu (prepare-vllm-chunks.sh) plus five wheels (loguru: 0.33 imports compressed_tensors
# on every model load, and the 0.26 set's compressed_tensors needs it); 0.33 goes into its own folder placed
# before the 0.26 install on PYTHONPATH, so one staging serves both versions side by side.
#
#   here, from the repository root:   bash benchmarks/infra/gpu_vllm033.sh prepare
#       downloads vllm 0.33.0, flashinfer-python 0.7.2.post1, oss-harmony 0.0.11, orjson 3.11.6 and
#       loguru 0.7.3 (about 384 MiB) into .gpu/wheels033 and splits them into .gpu/q0 .. .gpu/q7 of at most
#       54 MiB (a device call carries 64 MiB with the working tree, about 8 MiB)
#   there, one device call per chunk K, back to back (carry [".gpu/qK"]):
#       bash benchmarks/infra/gpu_vllm033.sh stage
#   there, once, after the 0.26 set was staged and installed (real_weights_gpu.sh setup):
#       bash benchmarks/infra/gpu_vllm033.sh install      # vLLM 0.33 into /tmp/site033
#       PYTHONPATH=/tmp/site033:/tmp/site:/tmp/site-plugin python3 -m benchmarks.e2e ...
#
# Run on an H100 on 2026-11-25: 0.33's compiled ops load and serve under the image's torch 2.11 (its
# extensions use only the stable libtorch ABI; _qutlass_C, a Blackwell FP4 library, lacks three
# symbols and was not needed); results in benchmarks/results/h100_e2e_vllm033_2026-11-25.*.
set -euo pipefail
STAGE=${STAGE:-/tmp/stage033}
SITE=${SITE033:-/tmp/site033}
WHEELS=(vllm==0.33.0 flashinfer-python==0.7.2.post1 oss-harmony==0.0.11 orjson==3.11.6 loguru==0.7.3)
CHUNK_MIB=54

case "${1:-}" in
  prepare)
    root="$(git rev-parse --show-toplevel)"
    cd "$root"
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    mkdir -p .gpu/wheels033
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d .gpu/wheels033 "${WHEELS[@]}"
    rm -rf .gpu/q[0-9]*
    # every wheel cut into pieces named after it (NAME.whl.partNN), the pieces packed in order
    tmp=$(mktemp -d)
    for w in .gpu/wheels033/*.whl; do split -b ${CHUNK_MIB}M -d -a 2 "$w" "$tmp/$(basename "$w").part"; done
    n=0; used=0; mkdir -p .gpu/q0
    for p in $(find "$tmp" -type f -printf '%f\n' | sort); do
      sz=$(stat -c %s "$tmp/$p")
      if [ $((used + sz)) -gt $((CHUNK_MIB * 1024 * 1024)) ]; then n=$((n + 1)); mkdir -p .gpu/q$n; used=0; fi
      mv "$tmp/$p" .gpu/q$n/; used=$((used + sz))
    done
    rmdir "$tmp"
    (cd .gpu/wheels033 && sha256sum ./*.whl) > .gpu/q$n/SHA256SUMS
    echo "chunks (one device call each, carry [\".gpu/qK\"], command: bash benchmarks/infra/gpu_vllm033.sh stage):"
    du -sh .gpu/q[0-9]* | sed 's#\.gpu/##' ;;
  stage)
    mkdir -p "$STAGE"
    for d in .gpu/q[0-9]*; do [ -d "$d" ] && cp "$d"/* "$STAGE"/; done
    echo "staged: $(find "$STAGE" -maxdepth 1 -type f | wc -l) files, $(du -sm "$STAGE" | cut -f1) MB" ;;
  install)
    cd "$STAGE"
    [ -f SHA256SUMS ] || { echo "$STAGE/SHA256SUMS missing: the last chunk was not staged" >&2; exit 2; }
    while read -r _ w; do
      w=${w#./}
      [ -f "$w" ] || cat "$w".part* > "$w"
    done < SHA256SUMS
    sha256sum -c --quiet SHA256SUMS
    if [ ! -f "$SITE/vllm/__init__.py" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" ./*.whl
    fi
    PYTHONPATH="$SITE:/tmp/site" python3 -c "import vllm, torch, flashinfer; \
print('vllm', vllm.__version__, 'flashinfer', flashinfer.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" ;;
  *)
    echo "usage: $0 prepare | stage | install" >&2
    exit 2 ;;
esac
