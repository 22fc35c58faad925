#!/usr/bin/env bash
# The GPU machine's wheel bundle under its first name: runs scripts/gpu/bundle.sh with the same arguments and
# environment (builds .gpu_bundle/; scripts/gpu/README.md).
exec bash "$(dirname "$0")/gpu/bundle.sh" "$@"
