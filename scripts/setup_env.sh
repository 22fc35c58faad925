#!/usr/bin/env bash
# Installs what acco_ds needs on a fresh machine, without pulling CUDA wheels on a CPU-only box:
# torch first (pinned: the CPU build here; keep the build you have where torch is already installed),
# then the package itself (editable) with its test/dev extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "torch==${ACCO_DS_TORCH_VERSION:-2.13.0}"
fi
TORCH_PIN="torch==$("$PY" -c 'import torch; print(torch.__version__)')"
"$PY" -m pip install --quiet -e ".[dev]" "$TORCH_PIN"
