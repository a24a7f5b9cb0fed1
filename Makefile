# Every target sets up what it needs from scratch: `make demo` and `make test` work on a
# fresh machine with Python 3.11+.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN_DIR ?= runs/demo

.PHONY: setup test test-all test-oldest lint format demo bench clean docs

$(BIN)/clew: pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first, pinned, so that resolving the other dependencies never swaps in another
	# (multi-GB) torch build.
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,ray,serve,s3]"
	touch $(BIN)/clew

setup: $(BIN)/clew

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

test-all: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not gpu"

# The model-facing tests against the oldest transformers clew claims (5.17),
# in a venv of their own (.venv-oldest).
OLDEST := .venv-oldest
test-oldest:
	test -x $(OLDEST)/bin/python || $(PY) -m venv $(OLDEST)
	$(OLDEST)/bin/pip install -q torch==2.13.0
	$(OLDEST)/bin/pip install -q "transformers==5.17.0" -e . pytest hypothesis pytest-timeout
	HF_HUB_OFFLINE=1 $(OLDEST)/bin/python -m pytest -q -p no:cacheprovider tests/rollout/test_rollout.py \
		tests/trainer/test_sft.py tests/train/test_train_worker.py tests/models/test_qwen3vl.py tests/models/test_models.py \
		tests/kernels/test_vision_attention.py tests/trainer/test_trainer.py

lint: setup
	$(BIN)/ruff check clew tests benchmarks
	$(BIN)/ruff format --check clew tests benchmarks

format: setup
	$(BIN)/ruff format clew tests benchmarks
	$(BIN)/ruff check --fix clew tests benchmarks

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/clew pipeline --config recipes/cpu-demo.yaml --output-dir $(RUN_DIR)

bench: setup
	$(BIN)/python benchmarks/env.py

clean:
	rm -rf $(VENV) $(OLDEST) runs .pytest_cache .ruff_cache

docs: setup
	$(BIN)/python -c "from clew.docs import write_docs; write_docs('docs')"
