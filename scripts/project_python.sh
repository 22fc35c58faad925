#!/usr/bin/env bash
# Prints the Python interpreter the project's commands use, creating the project environment if needed:
# - $PYTHON when set (a path or a command name);
# - the active virtual environment's or conda environment's python, used as it is;
# - otherwise ./.venv/bin/python, created with `python3 -m venv .venv` on first use (so nothing is ever
#   installed into a system Python, which PEP 668 distributions refuse anyway).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  command -v "$PYTHON"
  exit 0
fi
if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  echo "$VIRTUAL_ENV/bin/python"
  exit 0
fi
if [ -n "${CONDA_PREFIX:-}" ] && [ -x "$CONDA_PREFIX/bin/python" ]; then
  echo "$CONDA_PREFIX/bin/python"
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  BASE=${ACCO_DS_BASE_PYTHON:-python3}
  if ! "$BASE" -m venv .venv >&2; then
    echo "could not create the project environment .venv with '$BASE -m venv'." \
      "On Debian/Ubuntu install the venv module (apt-get install python3-venv), or activate an" \
      "environment of your own (it is then used as it is), or set PYTHON=/path/to/python." >&2
    rm -rf .venv
    exit 1
  fi
fi
echo "$PWD/.venv/bin/python"
