#!/usr/bin/env bash
# The GPU checks' entry point under its first name: runs scripts/gpu/checks.sh with the same arguments and
# environment (scripts/gpu/README.md: the steps, their limits, the results).
exec bash "$(dirname "$0")/gpu/checks.sh" "$@"
