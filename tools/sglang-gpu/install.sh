#!/usr/bin/env bash
# Runs on the GPU machine in the last call, from the project root: bash .sglang_gpu/zN/install.sh
# Checks that calls 1 .. N-1 left their parts in /tmp/sglwheels (else prints RESTART and exits 3), joins the parts,
# checks every sha256 (SHA_OK) and installs the set into /tmp/sglsite with the machine's own torch (SGLANG_INSTALLED).
# Afterwards: export PYTHONPATH=/tmp/sglsite:$PWD HF_HUB_OFFLINE=1
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
W=/tmp/sglwheels
PY=${PY:-/opt/torch/.venv/bin/python3}
N=$(cat "$here/NPARTS")
n=$(ls "$W" 2>/dev/null | wc -l)
[ "$n" = $((N - 1)) ] || { echo "RESTART from z1: machine not warm ($n files in $W, expected $((N - 1)))"; exit 3; }
cp "$here"/wheels.tar.part* "$here/SHA256SUMS" "$W"/
cd "$W"
cat wheels.tar.part* | tar -xf -
rm -f wheels.tar.part*
sha256sum -c --quiet SHA256SUMS
echo SHA_OK
rm -rf /tmp/sglsite
"$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target /tmp/sglsite "$W"/*.whl
echo SGLANG_INSTALLED
