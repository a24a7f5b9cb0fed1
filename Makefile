# Every target sets up what it needs from scratch: `make demo` and `make test` work on a
# fresh machine with Python 3.11+.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN_DIR ?= runs/demo

.PHONY: setup test test-all test-oldest lint format demo bench clean device-wheels

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

# The model-facing tests against the oldest transformers clew claims (the GPU image's 5.17),
# in a venv of their own (.venv-oldest).
OLDEST := .venv-oldest
test-oldest:
	test -x $(OLDEST)/bin/python || $(PY) -m venv $(OLDEST)
	$(OLDEST)/bin/pip install -q torch==2.13.0
	$(OLDEST)/bin/pip install -q "transformers==5.17.0" -e . pytest hypothesis pytest-timeout
	HF_HUB_OFFLINE=1 $(OLDEST)/bin/python -m pytest -q -p no:cacheprovider tests/test_rollout.py \
		tests/test_sft.py tests/test_train_worker.py tests/test_qwen3vl.py tests/test_models.py \
		tests/test_vision_attention.py tests/test_trainer.py

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

# Wheels for a GPU machine without network access whose image lacks pydantic (Python 3.12):
# copy `.whl` there and `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`.
device-wheels:
	rm -rf .whl
	$(PY) -m pip download -q pydantic --only-binary=:all: --python-version 3.12 \
		--platform manylinux2014_x86_64 -d .whl
	ls .whl

clean:
	rm -rf $(VENV) $(OLDEST) runs .pytest_cache .ruff_cache

docs: setup
	$(BIN)/python -c "from clew.docs import write_docs; write_docs('docs')"
