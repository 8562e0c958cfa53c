#!/usr/bin/env bash
# The real-weights runs on a GPU machine of the device tool (no network), from the repo root,
# after vLLM 0.26's chunks (.gpu/p0..p5, ../shared/gpu/prepare-vllm-chunks.sh) and a model's
# chunks (benchmarks/infra/gpu_stage_model.sh) were copied there, one device call per chunk.
#
#   bash benchmarks/infra/real_weights_gpu.sh setup                 # vLLM into /tmp/site, this plugin into /tmp/site-plugin
#   bash benchmarks/infra/real_weights_gpu.sh run CMD ARGS...       # CMD with both on the path, e.g.
#   bash benchmarks/infra/real_weights_gpu.sh run python3 -m benchmarks.accuracy --model /tmp/models/M ...
#
# The plugin is pip-installed so that vLLM finds its entry point (its metadata) in every process,
# the servers included; `setup` reinstalls it from the tree the call carried (the tree can change
# between calls). The benchmarks run as modules from the root (`python3 -m benchmarks.X`), where the
# checkout's copy of the package comes first on sys.path in that process: the same tree.
set -euo pipefail
export PYTHONPATH=/tmp/site:/tmp/site-plugin PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
case "${1:-}" in
  setup)
    bash .gpu/bin/install.sh
    rm -rf /tmp/site-plugin
    python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site-plugin . \
      2>&1 | grep -v "^WARNING: Running pip as" || true
    rm -rf build ./*.egg-info
    # from /tmp: the checkout itself would come first on sys.path and hide the installed copy
    (cd /tmp && python3 -c "import vllm_sparse_backend as p, importlib.metadata as m; print('plugin', p.__file__, \
[e.name for e in m.entry_points(group='vllm.general_plugins')])")
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader ;;
  run)
    shift
    exec "$@" ;;
  *)
    echo "usage: $0 setup | run CMD ARGS..." >&2
    exit 2 ;;
esac
