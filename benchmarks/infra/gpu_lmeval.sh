#!/usr/bin/env bash
# lm-eval 0.4.13 (the RULER judge of benchmarks/ruler.py) on a GPU machine of the device tool (no
# network there), in a folder of its own, never on the plugin's or vLLM's path.
#
# The GPU image (Python 3.12) already holds lm-eval's heavy needs (transformers, tokenizers,
# numpy, pandas, pyarrow, scikit-learn, sacrebleu, aiohttp, requests, jinja2, pyyaml, fsspec,
# huggingface-hub, xxhash); the rest is 29 small wheels (about 10 MiB: the list below is
# `pip freeze` of a venv with `lm-eval==0.4.13 wonderwords tenacity transformers` minus the image's
# packages as KINDS.md lists them). Three of them exist only as source: built here (pure Python).
#
#   here, from the repository root:   bash benchmarks/infra/gpu_lmeval.sh prepare
#       wheels into .gpu/lmeval (git-ignored through .git/info/exclude)
#   there, once per machine (carry [".gpu/lmeval"]):
#       bash benchmarks/infra/gpu_lmeval.sh install
#       installs them into /tmp/site-lmeval and writes /tmp/lmeval-python, the interpreter to give
#       benchmarks/ruler.py as --lmeval-python (python3 with only that folder on PYTHONPATH)
set -euo pipefail
SITE=${SITE_LMEVAL:-/tmp/site-lmeval}
WRAPPER=${LMEVAL_PYTHON_WRAPPER:-/tmp/lmeval-python}
BINARY=(annotated-types==0.8.0 chardet==6.0.0.post1 DataProperty==1.1.1 datasets==5.2.0 defusedxml==0.7.1
        dill==0.4.1 evaluate==0.4.6 httpcore2==2.16.2 httpx2==2.16.2 lm_eval==0.4.13 mbstrdecoder==1.1.5
        more-itertools==11.2.1 multiprocess==0.70.19 nltk==3.10.4 pathvalidate==3.3.1 pydantic==2.14.4
        pydantic_core==2.50.5 pytablewriter==1.2.1 pytz==2026.6 tabledata==1.3.5 tcolorpy==0.1.7
        tenacity==9.2.1 truststore==0.10.5 typepy==1.3.5 typing-inspection==0.4.5 wonderwords==3.0.1)
SOURCE_ONLY=(rouge_score==0.1.2 sqlitedict==2.1.0 word2number==1.1)

case "${1:-}" in
  prepare)
    root="$(git rev-parse --show-toplevel)"
    cd "$root"
    exclude="$(git rev-parse --git-common-dir)/info/exclude"  # also from a worktree
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
    rm -rf .gpu/lmeval && mkdir -p .gpu/lmeval
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d .gpu/lmeval "${BINARY[@]}"
    python3 -m pip wheel -q --no-deps -w .gpu/lmeval "${SOURCE_ONLY[@]}"
    ls .gpu/lmeval | wc -l
    du -sh .gpu/lmeval
    ;;
  install)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      .gpu/lmeval/*.whl
    printf '#!/bin/sh\nPYTHONPATH=%s exec %s "$@"\n' "$SITE" "$(command -v python3)" > "$WRAPPER"
    chmod +x "$WRAPPER"
    "$WRAPPER" -c "import importlib.metadata as m, lm_eval.tasks.ruler.niah_utils, wonderwords; print('lm-eval', m.version('lm_eval'))"
    ;;
  *)
    echo "usage: $0 prepare|install" >&2
    exit 2
    ;;
esac
