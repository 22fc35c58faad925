#!/usr/bin/env bash
# The test command of the README (and of .ci/run): lint, then the whole pytest suite on CPU.
# pytest's exit code 5 (no test collected) is a failure here: a suite that runs nothing proves nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ruff check . || exit 1
ruff format --check . || exit 1
python3 -m pytest -q -rs --durations=15 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
