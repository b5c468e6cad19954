"""Compile atom's MLA decode kernel for sm_90 without a GPU, at its default tile config and those of
``kernel_sweep.py mla``, over a bf16 and an fp8 latent cache, and print registers, spill bytes and shared
memory, the local-memory loads and stores inside the loop over the latent rows (spills outside it, e.g.
output addresses kept across the loop, cost one store and load per thread), whether wgmma runs, and how
many latent tiles the software pipeliner keeps in flight (Triton's bundled ptxas; see
gluon_compile_check.py):

    PYTHONPATH=$PWD python tests/gpu/mla_compile_check.py

Exit status 1 if a default config fails to compile. Spills are reported, not failed: the defaults are
the sweep's fastest on the GPU, and the 64-head one spills over an fp8 cache yet runs 2.1x the 16-head one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from gluon_compile_check import resources  # tests/gpu/, next to this script
from kernel_sweep import MLA_CONFIGS
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from atom.ops.triton import mla

FP8 = torch.float8_e4m3fn

# the pointers and strides that the launcher sees as multiples of 16 at DeepSeek's shapes
ALIGNED = "q_ptr cache_ptr seq_lens_ptr tables_ptr k_scale_ptr out_ptr part_out_ptr part_ml_ptr"
ALIGNED += " stride_qb stride_qh stride_cb stride_cs stride_ob stride_oh"


def compile_config(config: dict, fp8: bool):
    """The kernel at DeepSeek's dims (latent 512 + rope 64, block size 16, one context split)."""
    kernel, tile = mla._mla_decode_kernel, {k: v for k, v in config.items() if k.isupper()}
    signature = {name: "i32" for name in kernel.arg_names}
    signature.update(q_ptr="*bf16", cache_ptr="*fp8e4nv" if fp8 else "*bf16", seq_lens_ptr="*i32",
                     tables_ptr="*i32", k_scale_ptr="*fp32", out_ptr="*bf16", part_out_ptr="*fp32",
                     part_ml_ptr="*fp32", scale="fp32")  # fmt: skip
    constexprs = dict(RANK=512, ROPE=64, BLOCK_RANK=512, BLOCK_ROPE=64, BLOCK_SIZE=16, DOT_PRECISION="tf32",
                      SPLIT=False, HAS_SCALE=fp8, **tile)  # fmt: skip
    signature.update({k: "constexpr" for k in constexprs})
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED.split()}
    options = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)  # fmt: skip


def loop_spills(kernel) -> int:
    """Local-memory loads and stores (LDL/STL) inside the SASS's loops: the instructions between a
    backward branch and its target, read with the cuobjdump that Triton bundles."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    code = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    loops = [(int(t, 16), a) for a, op in code for t in re.findall(r"BRA (?:`\()?0x([0-9a-f]+)", op)]
    loops = [(t, a) for t, a in loops if t < a]
    return sum(any(t <= a <= b for t, b in loops) for a, op in code if re.search(r"\b(LDL|STL)\b", op))


def main() -> int:
    print(f"triton {triton.__version__}, sm_90")
    # the defaults at DeepSeek-V3's 128 heads (one row, eight) over each cache dtype, then every sweep config
    defaults = [(mla._decode_config(rows, 128, 512, 1 if fp8 else 2, True), fp8)
                for rows in (1, 8) for fp8 in (False, True)]
    bad = False
    for i, (config, fp8) in enumerate([*defaults, *((c, fp8) for c in MLA_CONFIGS for fp8 in (False, True))]):
        default = i < len(defaults)
        name = f"{'default ' if default else ''}{config} {'fp8' if fp8 else 'bf16'}"
        try:
            k = compile_config(config, fp8)
        except Exception as e:  # report and go on to the next config
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
            bad |= default
            continue
        regs, spills = resources(k)
        wgmma = "wgmma" in k.asm["ptx"]
        # latent tiles in flight: the depth of the pipeliner's shared buffers for them (none: not async;
        # HALVES tiles are 256 columns wide)
        depth = re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x\d+x(?:256|512)x", k.asm["ttgir"])
        print(f"{name}: regs={regs} spill_bytes={spills} loop_spills={loop_spills(k)} smem={k.metadata.shared} "
              f"wgmma={wgmma} latent_buffers={depth[0] if depth else 0}")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
