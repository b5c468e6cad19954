#!/usr/bin/env bash
# Builds, in the current git checkout, the chunks that bring SGLang 0.5.17 (the newest release pinned to the GPU
# machine's torch 2.11.0+cu130) to the GPU machine, which has no network. Run it once per machine, from the project
# root: bash tools/sglang-gpu/prepare.sh
#
# Layout written (".sglang_gpu/" is added to .git/info/exclude):
#   .sglang_gpu/z1 .. z(N-1)  one 60 MiB part each of an uncompressed tar of the wheels
#   .sglang_gpu/zN            the last part, SHA256SUMS (every wheel as shipped), NPARTS and install.sh
# Today N = 2 (about 116 MiB in all). pip checks every download against the sha256 pinned in wheels.txt; the
# sglang-kernel wheel is then slimmed (its FA3, FlashMLA, InfLLM and sm100 libraries, 1.1 GB unpacked, are dropped:
# SGLang loads them lazily and the triton attention backend never does), so SHA256SUMS records the slimmed wheel.
# The wheels are already deflated, so nothing is compressed again: the work is download and copy, little CPU.
# Needs python3 with pip, unzip, zip, sha256sum, tar and split.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git rev-parse --show-toplevel)
dest="$root/.sglang_gpu"
excl=$(git rev-parse --git-path info/exclude); case $excl in /*) ;; *) excl="$PWD/$excl" ;; esac
mkdir -p "$(dirname "$excl")"
grep -qx '/.sglang_gpu/' "$excl" 2>/dev/null || echo '/.sglang_gpu/' >> "$excl"
last=$(ls -d "$dest"/z* 2>/dev/null | sort -V | tail -1 || true)
if [ -n "$last" ] && [ -f "$last/install.sh" ] && [ -f "$last/SHA256SUMS" ]; then
  echo "already prepared: $dest ($(ls -d "$dest"/z* | wc -l) chunks; delete it to rebuild)"; du -sh "$dest"/z*; exit 0
fi
for t in unzip zip sha256sum tar split; do command -v $t >/dev/null || { echo "prepare.sh needs $t"; exit 1; }; done
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/w" "$tmp/k"
P="--no-deps --only-binary=:all: --require-hashes --python-version 3.12 --implementation cp"
for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1 manylinux_2_5; do
  P="$P --platform ${p}_x86_64"
done
python3 -m pip download -q $P -d "$tmp/w" -r "$here/wheels.txt"
K=sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl
[ -f "$tmp/w/$K" ] || { echo "pip did not fetch $K"; exit 1; }
# Slim sglang-kernel: keep sm90's common_ops and everything else, drop the big lazily loaded libraries, and drop their
# lines from RECORD so the wheel stays consistent.
drop='sgl_kernel/flash_ops\.abi3\.so|sgl_kernel/flashmla_ops\.abi3\.so|sgl_kernel/infllm_ops\.[^,]*\.so|sgl_kernel/sm100/'
(cd "$tmp/k" && unzip -q "$tmp/w/$K" && rm -rf sgl_kernel/flash_ops.abi3.so sgl_kernel/flashmla_ops.abi3.so \
  sgl_kernel/infllm_ops.*.so sgl_kernel/sm100 \
  && grep -Ev "^($drop)" sglang_kernel-0.4.5.dist-info/RECORD > RECORD.new \
  && mv RECORD.new sglang_kernel-0.4.5.dist-info/RECORD \
  && rm "$tmp/w/$K" && LC_ALL=C zip -q -r -X "$tmp/w/$K" .)
rm -rf "$tmp/k"
(cd "$tmp/w" && sha256sum *.whl > "$tmp/SHA256SUMS")
(cd "$tmp/w" && tar -cf - *.whl) | split -b 60M - "$tmp/wheels.tar.part"
rm -rf "$tmp/w" "$dest"; mkdir -p "$dest"
i=0; for part in $(ls "$tmp"/wheels.tar.part* | sort); do i=$((i+1)); mkdir -p "$dest/z$i"; mv "$part" "$dest/z$i/"; done
mv "$tmp/SHA256SUMS" "$dest/z$i/"
echo "$i" > "$dest/z$i/NPARTS"
cp "$here/install.sh" "$dest/z$i/"
du -sh "$dest"/z*
echo "$i calls: carry .sglang_gpu/z1 .. z$i in order, back to back (see tools/sglang-gpu/README.md)"
