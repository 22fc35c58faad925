#!/usr/bin/env bash
# Prints the folder torch's extension loader builds DeepSpeed's JIT ops into for this project: $TORCH_EXTENSIONS_DIR
# when set, else torch_extensions inside the project's Python environment (scripts/project_python.sh). Not the shared
# ~/.cache/torch_extensions: that one is rebuilt every time another ninja version touched it, and a build killed
# half-way there leaves a lock every later run waits on forever. Used by the set-up (which builds DeepSpeed's CPU
# Adam ops there ahead of their first use), the tests and the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${TORCH_EXTENSIONS_DIR:-}" ]; then
  echo "$TORCH_EXTENSIONS_DIR"
  exit 0
fi
PY=$(bash scripts/project_python.sh)
echo "$("$PY" -c 'import sys; print(sys.prefix)')/torch_extensions"
