#!/usr/bin/env bash
# The test command of the README (and of .ci/run): lint, then the pytest suite on CPU, with the project's
# Python (scripts/project_python.sh; `make test` installs into it first).
#   bash scripts/run_tests.sh [pytest args]         the full suite
#   bash scripts/run_tests.sh --fast [pytest args]  the edit loop: no test that starts ranks through a launcher
#                                                   (marker `launcher`; a launch attempted anyway fails loudly)
# Test files run in parallel workers (pytest-xdist, one file per worker at a time, so a file's module fixtures
# launch once): ACCO_DS_TEST_WORKERS of them (default: one more than the CPU count, at least 3, at most 4; 0 runs
# in this process). A launched test leaves a core idle much of the time (imports, start-up, waits on its peers),
# so more workers than cores finish the suite sooner: on 2 cores, 3 workers took 18 min 4 s from a fresh clone
# where 2 took 19 min 41 s.
# The summary lists the 15 slowest tests (--durations) and the 15 slowest test files (tests/conftest.py), so that
# the suite's creep shows in every run.
# pytest's exit code 5 (no test collected) is a failure here: a suite that runs nothing proves nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/project_python.sh) || exit 1
export PATH="$(dirname "$PY"):$PATH"
# DeepSpeed JIT-builds its CPU ops (fused_adam, cpu_adam) with torch's extension loader: into the project
# environment (scripts/extensions_dir.sh), where the set-up built them already.
PREFIX=$("$PY" -c 'import sys; print(sys.prefix)')
TORCH_EXTENSIONS_DIR=$(bash scripts/extensions_dir.sh)
export TORCH_EXTENSIONS_DIR
# Triton's kernel cache (the compile checks of tests/compile) in the project environment too: a fresh clone
# compiles every kernel, as a fresh machine does, instead of finding ~/.triton/cache warm from another clone.
TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PREFIX/triton_cache}
export TRITON_CACHE_DIR
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cpus=$(nproc 2>/dev/null || echo 2)
workers=${ACCO_DS_TEST_WORKERS:-$(( cpus + 1 < 3 ? 3 : (cpus + 1 > 4 ? 4 : cpus + 1) ))}
parallel=()
if [ "$workers" -gt 0 ]; then
  parallel=(-n "$workers" --dist loadfile)
fi
select=()
if [ "${1:-}" = "--fast" ]; then
  shift
  export ACCO_DS_TEST_NO_LAUNCH=1
  select=(-m "not launcher")
fi
"$PY" -m ruff check . || exit 1
"$PY" -m ruff format --check . || exit 1
"$PY" -m pytest -q -rs --durations=15 "${parallel[@]}" "${select[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
