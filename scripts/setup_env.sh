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
# With a CPU-only torch: DeepSpeed (its pin from pyproject.toml) and ninja first, then DeepSpeed's CPU Adam ops
# (scripts/build_deepspeed_cpu_ops.py: about 3 CPU-minutes of compiling) build in the background while the rest
# installs, on the core one pip process leaves idle; the first test and the main job would otherwise wait for them.
build_pid=""
if "$PY" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' 2>/dev/null; then
  DS_PIN=$(grep -o '"deepspeed[^"]*"' pyproject.toml | head -1 | tr -d '"')
  "$PY" -m pip install --quiet "$DS_PIN" ninja "$TORCH_PIN"
  OPS_LOG="$STAMP_DIR/deepspeed_cpu_ops_build.log"
  PATH="$(dirname "$PY"):$PATH" TORCH_EXTENSIONS_DIR=$(bash scripts/extensions_dir.sh) \
    "$PY" scripts/build_deepspeed_cpu_ops.py >"$OPS_LOG" 2>&1 &
  build_pid=$!
  trap 'kill "$build_pid" 2>/dev/null || true' EXIT  # a failed install below does not leave it compiling
fi
"$PY" -m pip install --quiet -e ".[dev]" "$TORCH_PIN"
if [ -n "$build_pid" ] && ! wait "$build_pid"; then
  echo "acco_ds setup: DeepSpeed's CPU Adam ops did not build ahead (their first use builds them; see $OPS_LOG):" >&2
  tail -5 "$OPS_LOG" >&2
fi
echo "$digest" >"$STAMP"
echo "acco_ds installed into $("$PY" -c 'import sys; print(sys.prefix)')"
