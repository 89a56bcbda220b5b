# darts-bench: `make run` (the quickstart: tiny's plain, Surgery and DARTS rows of two merges, into runs/),
# `make run-full` (every row of tiny), `make reference` (the full tiny run into the committed results/tiny),
# `make test` (pytest, the full suite CI runs) and
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

.PHONY: install install-dev install-docs run run-full reference test test-fast docs docs-build bench clean

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

# the newcomer's first command: 10 of tiny's 79 rows (the routed / shared / inductive variants and three merges
# left out; `darts-bench run --dry-run --config tiny --rows '...'` plans it at ~3.7 min on 2 cores, ~7 min with
# the committed tiny run's measured/planned ratios); writes runs/tiny-quickstart, never results/
QUICK_ROWS ?= base,expert:*,ties,ties+surgery,ties+darts,task_arithmetic,task_arithmetic+surgery,task_arithmetic+darts
run: install
	$(BIN)/darts-bench run --suite all --config tiny --rows '$(QUICK_ROWS)' --out runs/tiny-quickstart

# every row of tiny (results/tiny/README.md: the committed run's command and wall time), into runs/tiny
run-full: install
	$(BIN)/darts-bench run --suite all --config tiny

# refresh the committed reference on purpose (then review and commit results/tiny)
reference: install
	$(BIN)/darts-bench run --suite all --config tiny --out results/tiny

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
	rm -rf work .cache runs site
