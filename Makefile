# darts-bench: `make run` (full default pipeline), `make test` (pytest, the full suite CI runs) and
# `make test-fast` (no micro pool, Ray, DeepSpeed or slow test: tests/README.md). All create .venv if missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DATA ?= $(abspath ../shared/data)
export DARTS_BENCH_DATA ?= $(DATA)
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TORCH_EXTENSIONS_DIR ?= $(abspath .cache/torch_extensions)
export DS_ACCELERATOR ?= cpu

.PHONY: install install-dev install-docs run test test-fast docs docs-build bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch is pinned to the CPU build on the machine unless a torch is already installed in the venv
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

$(VENV)/.installed-docs: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[docs]"
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev
install-docs: $(VENV)/.installed-docs

run: install
	$(BIN)/darts-bench run --suite all --config tiny

test: install-dev
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

# the markers are declared in pyproject.toml; tests/README.md lists what each leaves out
test-fast: install-dev
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not micro and not ray and not deepspeed and not slow" tests

# the documentation site (mkdocs.yml): `make docs` serves it on http://127.0.0.1:8000, `make docs-build` checks it
docs: install-docs
	$(BIN)/mkdocs serve

docs-build: install-docs
	$(BIN)/mkdocs build --strict

# make bench BENCH_ARGS="--tier smollm2-135m --model-dir DIR" for a real SmolLM2 checkpoint dir
BENCH_ARGS ?=
bench: install
	$(BIN)/python benchmarks/run_all.py $(BENCH_ARGS)

clean:
	rm -rf work .cache site
