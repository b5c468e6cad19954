#!/usr/bin/env bash
# Runs on the GPU machine in the last call, from the project root: bash .sglang_gpu/zN/install.sh
# Checks that calls 1 .. N-1 left their parts, whole, in /tmp/sglwheels (else prints RESTART and exits 3), joins the
# parts, checks every sha256 (SHA_OK) and installs the set into /tmp/sglsite with the machine's own torch
# (SGLANG_INSTALLED). SGL_WHEELS, SGL_SITE and PY override /tmp/sglwheels, /tmp/sglsite and the python (a local
# dry run). Afterwards: export PYTHONPATH=/tmp/sglsite:$PWD HF_HUB_OFFLINE=1
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
W=${SGL_WHEELS:-/tmp/sglwheels}
SITE=${SGL_SITE:-/tmp/sglsite}
PY=${PY:-/opt/torch/.venv/bin/python3}
N=$(cat "$here/NPARTS")
[ "$(wc -l < "$here/PARTS")" = "$N" ] || { echo "PARTS lists $(wc -l < "$here/PARTS") parts, NPARTS says $N"; exit 1; }
# Every part but the last (which is here) must be in $W with its size: a machine that was given back between the
# calls comes back without them.
missing=""
k=0
while read -r name size; do
  k=$((k + 1))
  if [ "$k" = "$N" ]; then
    [ "$(stat -c %s "$here/$name")" = "$size" ] || { echo "$here/$name has the wrong size"; exit 1; }
  elif [ ! -f "$W/$name" ] || [ "$(stat -c %s "$W/$name")" != "$size" ]; then
    missing="$missing z$k($name)"
  fi
done < "$here/PARTS"
if [ -n "$missing" ]; then
  echo "RESTART from z1: machine not warm or a call was skipped; missing in $W:$missing ($(ls "$W" 2>/dev/null | wc -l) files there)"
  exit 3
fi
cp "$here"/wheels.tar.part* "$here/SHA256SUMS" "$W"/
cd "$W"
cat $(cut -d' ' -f1 "$here/PARTS") | tar -xf -
rm -f wheels.tar.part*
sha256sum -c --quiet SHA256SUMS
[ "$(ls *.whl | wc -l)" = "$(wc -l < SHA256SUMS)" ] || { echo "wheels other than SHA256SUMS lists are in $W"; exit 1; }
echo SHA_OK
rm -rf "$SITE"
"$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$SITE" "$W"/*.whl
echo SGLANG_INSTALLED
