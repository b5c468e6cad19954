#!/usr/bin/env bash
# `bash tools/gpu-calls/copy_tree.sh DEST`: this checkout without the wheel chunks and virtual environments, as a
# second atom tree for `tests/gpu/e2e_compare.py --tree NAME=DEST` (edit DEST's code to A/B a change in one call)
set -euo pipefail
rm -rf "$1"
mkdir -p "$1"
tar --exclude=./.whl_vllm --exclude=./.whl_ct --exclude=./.stage_run --exclude="./.venv*" -cf - . | tar -xf - -C "$1"
