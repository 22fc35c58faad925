PY ?= python3

.PHONY: setup train test lint bench gpu-checks

setup:
	bash scripts/setup_env.sh

train: setup
	acco-train

test: setup
	bash scripts/run_tests.sh

lint:
	ruff check . && ruff format --check .

bench: setup
	$(PY) benchmarks/bench_kernels.py
	$(PY) benchmarks/bench_e2e.py

gpu-checks:
	bash scripts/gpu_checks.sh
