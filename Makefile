# Every target sets up what it needs from scratch: `make demo` and `make test` work on a
# fresh machine with Python 3.11+.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN_DIR ?= runs/demo

.PHONY: setup test test-all lint format demo bench clean

$(BIN)/clew: pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first, pinned: a range alone would pull a multi-GB CUDA build (see NOTES).
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,ray,serve,s3]"
	touch $(BIN)/clew

setup: $(BIN)/clew

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

test-all: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not gpu"

lint: setup
	$(BIN)/ruff check clew tests benchmarks experiments
	$(BIN)/ruff format --check clew tests benchmarks experiments

format: setup
	$(BIN)/ruff format clew tests benchmarks
	$(BIN)/ruff check --fix clew tests benchmarks

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/clew demo --output-dir $(RUN_DIR)

bench: setup
	$(BIN)/python benchmarks/env.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache

docs: setup
	$(BIN)/python -c "from clew.docs import write_docs; write_docs('docs')"
