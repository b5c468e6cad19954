#!/usr/bin/env bash
# Builds, in the current git checkout, the chunks that bring SGLang 0.5.17 (the newest release pinned to the GPU
# machine's torch 2.11.0+cu130) to the GPU machine, which has no network. Run it once per machine, from the project
# root: bash tools/sglang-gpu/prepare.sh
#
# Layout written (".sglang_gpu/" is added to .git/info/exclude):
#   .sglang_gpu/z1 .. z(N-1)  one 60 MiB part each of an uncompressed tar of the wheels
#   .sglang_gpu/zN            the last part, SHA256SUMS (every wheel as shipped), NPARTS, PARTS and install.sh
# Today N = 3 (about 130 MiB in all; z3 about 10 MiB, so the last call also has room for the staged checkout). pip
# checks every download against the sha256 pinned in wheels.txt; the sglang-kernel wheel is then slimmed (its FA3,
# FlashMLA, InfLLM and sm100 libraries, 1.1 GB unpacked, are dropped: SGLang loads them lazily and the triton attention
# backend never does) and patched (its rmsnorm family and top-k/top-p renorm hand bf16/fp16 work to flashinfer, which
# would JIT-compile flashinfer's norm module with nvcc at the first forward; they keep sgl_kernel's own compiled kernels
# unless SGL_KERNEL_USE_FLASHINFER=1), so SHA256SUMS records the rebuilt wheel.
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
# lines from RECORD so the wheel stays consistent. Then patch elementwise.py and sampling.py so that flashinfer being
# importable does not route sgl_kernel's rmsnorm/fused_add_rmsnorm/gemma_* and top-k/top-p renorm to flashinfer's
# JIT-compiled kernels (their `try: import flashinfer.X` raises ImportError first, the upstream fallback when flashinfer
# is absent), and rewrite those files' RECORD lines.
drop='sgl_kernel/flash_ops\.abi3\.so|sgl_kernel/flashmla_ops\.abi3\.so|sgl_kernel/infllm_ops\.[^,]*\.so|sgl_kernel/sm100/'
(cd "$tmp/k" && unzip -q "$tmp/w/$K" && rm -rf sgl_kernel/flash_ops.abi3.so sgl_kernel/flashmla_ops.abi3.so \
  sgl_kernel/infllm_ops.*.so sgl_kernel/sm100 \
  && grep -Ev "^($drop)" sglang_kernel-0.4.5.dist-info/RECORD > RECORD.new \
  && mv RECORD.new sglang_kernel-0.4.5.dist-info/RECORD)
python3 - "$tmp/k" <<'PY'
import base64, hashlib, pathlib, sys

root = pathlib.Path(sys.argv[1])
guard = (
    '    if __import__("os").environ.get("SGL_KERNEL_USE_FLASHINFER") != "1":  # tools/sglang-gpu/prepare.sh\n'
    '        raise ImportError("sgl_kernel keeps its own kernels")\n'
)
new = {}
for rel, mod in (("sgl_kernel/elementwise.py", "norm"), ("sgl_kernel/sampling.py", "sampling")):
    path = root / rel
    text = path.read_text()
    line = f"    import flashinfer.{mod} as _flashinfer_{mod}\n"
    if text.count(line) != 1 or text.count("except ImportError:\n    _has_flashinfer = False") != 1:
        sys.exit(f"prepare.sh: {rel} no longer imports flashinfer.{mod} as expected; update the patch")
    data = text.replace(line, guard + line).encode()
    path.write_bytes(data)
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    new[rel] = f"{rel},sha256={digest},{len(data)}"
record = root / "sglang_kernel-0.4.5.dist-info" / "RECORD"
lines = record.read_text().splitlines()
out = [new.pop(l.split(",")[0], l) for l in lines]
if new:
    sys.exit(f"prepare.sh: RECORD lacks {sorted(new)}")
record.write_text("\n".join(out) + "\n")
PY
(cd "$tmp/k" && rm "$tmp/w/$K" && LC_ALL=C zip -q -r -X "$tmp/w/$K" .)
rm -rf "$tmp/k"
(cd "$tmp/w" && sha256sum *.whl > "$tmp/SHA256SUMS")
(cd "$tmp/w" && tar -cf - *.whl) | split -b 60M - "$tmp/wheels.tar.part"
rm -rf "$tmp/w" "$dest"; mkdir -p "$dest"
i=0; for part in $(ls "$tmp"/wheels.tar.part* | sort); do i=$((i+1)); mkdir -p "$dest/z$i"; mv "$part" "$dest/z$i/"; done
mv "$tmp/SHA256SUMS" "$dest/z$i/"
echo "$i" > "$dest/z$i/NPARTS"
# PARTS: every part's name and size, in order; install.sh checks that calls 1 .. N-1 left theirs whole.
(cd "$dest" && for d in $(ls -d z* | sort -V); do for f in "$d"/wheels.tar.part*; do
  echo "$(basename "$f") $(stat -c %s "$f")"; done; done) > "$tmp/PARTS"
mv "$tmp/PARTS" "$dest/z$i/"
cp "$here/install.sh" "$dest/z$i/"
du -sh "$dest"/z*
last=$(du -sm "$dest/z$i" | cut -f1)
[ "$last" -le 56 ] || echo "WARNING: z$i is $last MiB: with .stage_sglang and the tree, the last call may pass 64 MiB"
echo "$i calls, back to back (tools/sglang-gpu/README.md, section 2):"
for k in $(seq 1 $((i - 1))); do
  if [ "$k" = 1 ]; then c='rm -rf /tmp/sglwheels; mkdir -p /tmp/sglwheels && cp .sglang_gpu/z1/* /tmp/sglwheels/ && ls -l /tmp/sglwheels'
  else c="[ \$(ls /tmp/sglwheels | wc -l) = $((k - 1)) ] || { echo RESTART from call 1; exit 3; }; cp .sglang_gpu/z$k/* /tmp/sglwheels/ && ls -l /tmp/sglwheels"; fi
  echo "  call $k: carry .sglang_gpu/z$k (timeout_s 120): $c"
done
echo "  call $i: carry .sglang_gpu/z$i and .stage_sglang (timeout_s 600): bash .sglang_gpu/z$i/install.sh && ..."
