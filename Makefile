# The project's Python: the active virtual or conda environment as it is, else ./.venv (created on first
# use by scripts/project_python.sh). Override with `make PYTHON=/path/to/python ...`.
PY := $(shell bash scripts/project_python.sh)
export PYTHON := $(PY)

.PHONY: setup train test test-fast lint bench gpu-checks

setup:
	bash scripts/setup_env.sh

train: setup
	TORCH_EXTENSIONS_DIR="$$(bash scripts/extensions_dir.sh)" $(PY) -m acco_ds.train

test: setup
	bash scripts/run_tests.sh

test-fast: setup
	bash scripts/run_tests.sh --fast

lint:
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

bench: setup
	$(PY) -m benchmarks.kernels
	$(PY) -m benchmarks.e2e

gpu-checks:
	bash scripts/gpu/checks.sh
