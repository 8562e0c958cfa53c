#!/usr/bin/env bash
# The stack a user's `pip install vllm` brings (issue 44): vLLM 0.33.0 on the torch it pins
# (2.14.0, CUDA 13.0), Triton 3.8.0 and flashinfer-python 0.7.2.post1, staged on a GPU machine of
# the device tool (no network; its image has torch 2.11 + Triton 3.6) into folders of its own that
# come before the image's site-packages. Sizes, what is carried and why, and the call plan:
# docs/vllm-versions.md, "The user's stack (issue 44)".
#
#   here, from the repository root:
#     bash benchmarks/infra/gpu_user_stack.sh prepare [full|lean|triton]     # default full
#       downloads the wheels (and vLLM 0.33.0's sdist, for its test tree) into .gpu/user-wheels and
#       packs them with pack_model --files into .gpu/u/m0 .. mN of 52 MiB (sha256 of every file)
#   there, one device call per chunk K, back to back (carry [".gpu/u/mK"]):
#     bash benchmarks/infra/gpu_user_stack.sh stage
#   there, once after the last chunk (the same call can go on to the tests):
#     bash benchmarks/infra/gpu_user_stack.sh install
#     bash benchmarks/infra/gpu_user_stack.sh run python3 -m pytest -q -m gpu tests/kernels
#     bash benchmarks/infra/vllm_backend_tests.sh density1
#
# Tiers (what `prepare` packs; their sizes and chunk counts are in the doc above):
#   triton  Triton 3.8.0 alone, over the image's torch 2.11: the kernels' GPU
#           tests on the Triton a user gets, no vLLM.
#   lean    torch 2.14.0, Triton 3.8.0, torchvision 0.29.0, NCCL 2.30.7 (torch 2.14 links NCCL
#           functions that the 2.28.9 torch 2.11 pins lacks), vLLM 0.33.0, flashinfer-python
#           0.7.2.post1, vLLM's Python dependencies the image lacks (../shared/gpu/
#           vllm026-extra-deps.txt; oss-harmony, orjson and loguru as in gpu_vllm033.sh), tblib
#           (vLLM's test conftest), cuda-bindings 13.0.3 (installed only over an older one) and
#           vLLM's test tree.
#   full    lean + the cuBLAS 13.1.1.3, cuDNN 9.24.0.43 and cuSPARSELt 0.8.1 torch 2.14 pins (the
#           builds torch 2.11 pins resolve every symbol torch 2.14 links, but torch refuses cuDNN
#           9.19 at its first cuDNN call, and a user's GEMMs run on the pinned cuBLAS).
#
# `install` unpacks /tmp/ustage (pack_model checks every file's sha256), installs the wheels with
# pip (--no-index --no-deps) into /tmp/site-user (torch, Triton and the NVIDIA libraries together:
# torch finds them through its RPATH, ../../nvidia/*/lib) and /tmp/site-user-vllm (the rest),
# this plugin into /tmp/site-plugin (vLLM finds its entry point in every process), vLLM's test
# tree into /tmp/vllm-src, and prints the versions it then imports. Each step is skipped when done.
# `run CMD ...` runs CMD with PYTHONPATH set for the staged stack; `env` prints that setting.
# Environment overrides: STAGE (/tmp/ustage), SITE (/tmp/site-user), VLLM_SRC_ROOT (/tmp/vllm-src),
# SHARED_GPU (../shared/gpu), CHUNK_MIB (52).
set -euo pipefail

STAGE=${STAGE:-/tmp/ustage}
SITE=${SITE:-/tmp/site-user}
SITE_VLLM=${SITE}-vllm
SITE_PLUGIN=${SITE_PLUGIN:-/tmp/site-plugin}
VLLM_SRC_ROOT=${VLLM_SRC_ROOT:-/tmp/vllm-src}
CHUNK_MIB=${CHUNK_MIB:-52}
VLLM_VERSION=0.33.0
TESTS_TARBALL=vllm-$VLLM_VERSION-tests.tar.gz

TRITON=(triton==3.8.0)
TORCH=(torch==2.14.0 torchvision==0.29.0 nvidia-nccl-cu13==2.30.7)
VLLM=(vllm==$VLLM_VERSION flashinfer-python==0.7.2.post1 oss-harmony==0.0.11 orjson==3.11.6 loguru==0.7.3 tblib==3.2.2)
CUDA_PINNED=(nvidia-cublas==13.1.1.3 nvidia-cudnn-cu13==9.24.0.43 nvidia-cusparselt-cu13==0.8.1)
CUDA_BINDINGS=cuda-bindings==13.0.3
# the GPU image's Python 3.12.3 is Ubuntu 24.04's (glibc 2.39); llguidance needs manylinux_2_34
PLATFORMS=(--only-binary=:all: --python-version 3.12 --implementation cp
           --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
           --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_18_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64
           --platform manylinux2010_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64
           --platform linux_x86_64 --platform any)

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}

# the wheels of the torch group go to $SITE, the rest to $SITE_VLLM
is_torch_group() {
  case "$(basename "$1")" in
    torch-* | triton-* | torchvision-* | nvidia_* | cuda_bindings-*) return 0 ;;
    *) return 1 ;;
  esac
}

stack_pythonpath() {
  local p=$SITE
  [ -d "$SITE_VLLM" ] && p=$p:$SITE_VLLM
  [ -d "$SITE_PLUGIN" ] && p=$p:$SITE_PLUGIN
  # FA4's CuTe DSL, where staged: nvidia-cutlass-dsl puts `cutlass` on the path through a .pth
  # file, which a PYTHONPATH folder does not read
  [ -d "$SITE_VLLM/nvidia_cutlass_dsl/dsl_packages" ] && p=$p:$SITE_VLLM/nvidia_cutlass_dsl/dsl_packages
  echo "$p"
}

# vLLM's sdist from the registry's JSON index, its sha256 checked; pyproject.toml and tests/ repacked
fetch_vllm_tests() {
  local dest=$1
  python3 - "$dest" "$VLLM_VERSION" <<'EOF'
import hashlib, json, pathlib, sys, tarfile, urllib.request
dest, version = pathlib.Path(sys.argv[1]), sys.argv[2]
name = f"vllm-{version}.tar.gz"
req = urllib.request.Request("https://pypi.org/simple/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
entry = next(f for f in json.load(urllib.request.urlopen(req, timeout=120))["files"] if f["filename"] == name)
sdist = dest / name
if not sdist.is_file() or hashlib.sha256(sdist.read_bytes()).hexdigest() != entry["hashes"]["sha256"]:
    data = urllib.request.urlopen(entry["url"], timeout=600).read()
    if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
        raise SystemExit(f"{name}: sha256 differs from the index's")
    sdist.write_bytes(data)
top = f"vllm-{version}"
with tarfile.open(sdist) as src, tarfile.open(dest / f"{top}-tests.tar.gz", "w:gz") as out:
    kept = 0
    for member in src.getmembers():
        if member.name == f"{top}/pyproject.toml" or member.name.startswith(f"{top}/tests/"):
            out.addfile(member, src.extractfile(member) if member.isfile() else None)
            kept += 1
print(f"{name}: sha256 ok; {kept} entries (pyproject.toml, tests/) -> {top}-tests.tar.gz")
EOF
}

prepare() {
  local tier=${1:-full} root shared wheels
  root="$(git rev-parse --show-toplevel)"
  cd "$root"
  git check-ignore -q .gpu/u || { echo ".gpu/ is not git-ignored here" >&2; exit 2; }
  wheels=.gpu/user-wheels/$tier
  rm -rf "$wheels"
  mkdir -p "$wheels"
  local want=("${TRITON[@]}")
  case $tier in
    triton) ;;
    lean | full)
      shared=${SHARED_GPU:-$root/../shared/gpu}
      [ -f "$shared/vllm026-extra-deps.txt" ] || { echo "no $shared/vllm026-extra-deps.txt (set SHARED_GPU)" >&2; exit 2; }
      want+=("${TORCH[@]}" "${VLLM[@]}" "$CUDA_BINDINGS")
      [ "$tier" = full ] && want+=("${CUDA_PINNED[@]}")
      # the 0.26 set's flashinfer-python would shadow 0.33's pin
      grep -v -i '^flashinfer-python' "$shared/vllm026-extra-deps.txt" > "$wheels/.deps.txt"
      python3 -m pip download -q --no-deps "${PLATFORMS[@]}" -d "$wheels" -r "$wheels/.deps.txt"
      rm "$wheels/.deps.txt"
      fetch_vllm_tests "$wheels"
      rm -f "$wheels/vllm-$VLLM_VERSION.tar.gz" ;;
    *) usage ;;
  esac
  python3 -m pip download -q --no-deps "${PLATFORMS[@]}" -d "$wheels" "${want[@]}"
  echo "$tier: $(find "$wheels" -maxdepth 1 -type f | wc -l) files, $(du -sm "$wheels" | cut -f1) MiB"
  mkdir -p .gpu/u
  python3 -m benchmarks.infra.pack_model pack --files "$wheels"/* --out .gpu/u --chunk-mib "$CHUNK_MIB"
  local n
  n=$(find .gpu/u -maxdepth 1 -name 'm[0-9]*' | wc -l)
  echo "$n chunk calls: carry [\".gpu/u/mK\"] for K = 0 .. $((n - 1)), command:"
  echo "  bash benchmarks/infra/gpu_user_stack.sh stage"
  echo "then: bash benchmarks/infra/gpu_user_stack.sh install"
}

stage() {
  mkdir -p "$STAGE"
  local d copied=0
  for d in .gpu/u/m[0-9]*; do
    [ -d "$d" ] || continue
    cp -n "$d"/* "$STAGE"/
    copied=$((copied + 1))
  done
  [ "$copied" -gt 0 ] || { echo "no .gpu/u/mK folder carried" >&2; exit 2; }
  echo "staged: $(find "$STAGE" -maxdepth 1 -name 'model.part*' | wc -l) parts, $(du -sm "$STAGE" | cut -f1) MiB"
}

# cuda-bindings: torch 2.14 wants >= 13.0.3, < 14; the image's is kept unless older
bindings_needed() {
  python3 - <<'EOF'
import importlib.metadata as md
try:
    have = tuple(int(x) for x in md.version("cuda-bindings").split(".")[:3])
except (md.PackageNotFoundError, ValueError):
    have = (0,)
raise SystemExit(0 if have < (13, 0, 3) or have >= (14,) else 1)
EOF
}

install() {
  local t0 unpacked=$STAGE/unpacked
  t0=$(date +%s)
  [ -f vllm_sparse_backend/__init__.py ] || { echo "run from the repository root" >&2; exit 2; }
  if [ ! -f "$unpacked/.unpacked" ]; then
    python3 -m benchmarks.infra.pack_model unpack "$unpacked" --stage "$STAGE" | cut -c1-200
    touch "$unpacked/.unpacked"
    rm -f "$STAGE"/model.part*  # the disk holds parts, wheels and sites otherwise
  fi
  echo "[unpack] $(( $(date +%s) - t0 )) s"
  local w torch_group=() rest=()
  for w in "$unpacked"/*.whl; do
    if [[ $(basename "$w") == cuda_bindings-* ]] && ! bindings_needed; then
      echo "cuda-bindings: the image's $(python3 -m pip show cuda-bindings 2>/dev/null | sed -n 's/^Version: //p') is kept"
      continue
    fi
    if is_torch_group "$w"; then torch_group+=("$w"); else rest+=("$w"); fi
  done
  local pip=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check)
  if [ ! -f "$SITE/.installed" ]; then
    rm -rf "$SITE"
    "${pip[@]}" --target "$SITE" "${torch_group[@]}" &
    local torch_pid=$!
    if [ ${#rest[@]} -gt 0 ]; then
      rm -rf "$SITE_VLLM"
      "${pip[@]}" --target "$SITE_VLLM" "${rest[@]}"
    fi
    wait "$torch_pid"
    touch "$SITE/.installed"
  fi
  echo "[pip] $(( $(date +%s) - t0 )) s: $SITE ($(du -sm "$SITE" | cut -f1) MiB)${rest:+, $SITE_VLLM ($(du -sm "$SITE_VLLM" 2>/dev/null | cut -f1) MiB)}"
  if [ -f "$unpacked/$TESTS_TARBALL" ] && [ ! -f "$VLLM_SRC_ROOT/vllm-$VLLM_VERSION/tests/v1/attention/test_attention_backends.py" ]; then
    mkdir -p "$VLLM_SRC_ROOT"
    tar xzf "$unpacked/$TESTS_TARBALL" -C "$VLLM_SRC_ROOT"
    echo "[tests] vLLM's test tree in $VLLM_SRC_ROOT/vllm-$VLLM_VERSION"
  fi
  if [ -d "$SITE_VLLM" ]; then
    rm -rf "$SITE_PLUGIN"
    PYTHONPATH=$SITE:$SITE_VLLM python3 -m pip install -q --no-deps --no-build-isolation --no-index \
      --target "$SITE_PLUGIN" . 2>&1 | grep -v "^WARNING: Running pip as" || true
    rm -rf build ./*.egg-info
  fi
  # from /tmp: the checkout would come first on sys.path and hide the installed plugin
  (cd /tmp && PYTHONPATH=$(stack_pythonpath) python3 - <<'EOF'
import importlib.metadata as md, importlib.util
import torch, triton
try:  # torch refuses a cuDNN older than the one it was built with (the lean tier keeps the image's)
    cudnn = torch.backends.cudnn.version()
except RuntimeError as e:
    cudnn = f"refused: {str(e).splitlines()[0][:160]}"
print("torch", torch.__version__, "from", torch.__file__.rsplit("/", 2)[0], "CUDA", torch.version.cuda,
      "NCCL", ".".join(map(str, torch.cuda.nccl.version())), "cuDNN", cudnn)
print("triton", triton.__version__, "from", triton.__file__.rsplit("/", 2)[0])
print("device", torch.cuda.get_device_name(), "cuBLAS ok:", bool((torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda"))[0, 0] == 64))
if importlib.util.find_spec("vllm") is not None:
    import vllm, flashinfer, torchvision
    print("vllm", vllm.__version__, "flashinfer", flashinfer.__version__, "torchvision", torchvision.__version__)
    print("plugin entry points:", [e.name for e in md.entry_points(group="vllm.general_plugins")])
EOF
  )
  echo "[install] $(( $(date +%s) - t0 )) s; PYTHONPATH=$(stack_pythonpath)"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  stage) stage ;;
  install) install ;;
  env) echo "export PYTHONPATH=$(stack_pythonpath) HF_HUB_OFFLINE=1" ;;
  run)
    shift
    [ $# -gt 0 ] || usage
    PYTHONPATH=$(stack_pythonpath) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 exec "$@" ;;
  *) usage ;;
esac
