#!/usr/bin/env bash
# Installs what acco_ds needs into the project's Python (scripts/project_python.sh: the active virtual or
# conda environment, else ./.venv, created here), without pulling CUDA wheels on a CPU-only box: torch first
# (pinned: the CPU build here; the build already installed is kept), then the package itself (editable) with
# its test/dev extras, which also builds the C++/CUDA extensions. Safe to run again: when nothing the install
# depends on changed since the last run, it returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/project_python.sh)
STAMP_DIR=$("$PY" -c 'import sys; print(sys.prefix)')
STAMP="$STAMP_DIR/.acco_ds_setup_stamp"
digest=$( { echo "$PY"; cat pyproject.toml setup.py; find csrc -type f | LC_ALL=C sort | xargs cat; } | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$digest" ] && "$PY" -c "import acco_ds, deepspeed, torch" 2>/dev/null; then
  exit 0
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "torch==${ACCO_DS_TORCH_VERSION:-2.13.0}"
fi
TORCH_PIN="torch==$("$PY" -c 'import torch; print(torch.__version__)')"
"$PY" -m pip install --quiet -e ".[dev]" "$TORCH_PIN"
echo "$digest" >"$STAMP"
echo "acco_ds installed into $("$PY" -c 'import sys; print(sys.prefix)')"
