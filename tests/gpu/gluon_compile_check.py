"""Compile the Gluon kernels (prefill attention, MLA decode) for sm_90 without a GPU and print their
resource use.

    PYTHONPATH=$PWD /path/to/triton-3.6-venv/bin/python tests/gpu/gluon_compile_check.py \
        [--extra-site DIR]   # a site-packages that provides torch, appended after Triton's

Triton 3.6 (the GPU machine's) without a venv: unzip its cp311 wheel (``pip download --no-deps
triton==3.6.0``) into DIR and put DIR first on ``PYTHONPATH``; this repo's venv provides torch.

Triton bundles ptxas, so ``triton.compile`` of a ``GluonASTSource`` for ``GPUTarget("cuda",
90, 32)`` runs on the CPU; the compiled kernel's metadata gives registers, spills and shared
memory per config. Exit status 1 if a config fails to compile or spills.
"""

from __future__ import annotations

import argparse
import re
import sys

import triton  # the Triton under test, imported before any extra site

CONFIGS = [
    dict(),  # the default
    dict(block_n=128, stages=2, pingpong=True, consumer_regs=240),
    dict(block_n=128, stages=2, pingpong=False),
    dict(block_n=64, stages=3, pingpong=True),
    dict(block_n=128, stages=2, pingpong=True, head_dim=64),
    dict(cache_page=16),  # chunks over a cached prefix, pages of 16 rows
    dict(cache_page=128),
    dict(cache_page=16, head_dim=64),
    dict(dynamic=True),  # work items from a counter in global memory
    dict(dynamic=True, cache_page=16),
    dict(dynamic=True, q_regs=True),  # Q held in registers: the next item's Q loads during this one
    dict(dynamic=True, q_regs=True, cache_page=16, head_dim=64),
    dict(dynamic=True, cache_page=16, splits=4),  # key ranges split over programs, merged after
]


def compile_config(mod, cfg: dict):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    head_dim = cfg.get("head_dim", 128)
    full = {**mod.DEFAULT_CONFIG, **{k: v for k, v in cfg.items() if k != "cache_page"}}
    page = cfg.get("cache_page", 16)
    rows = min(page, full["block_n"])
    desc = "tensordesc<bf16[{}, {}],{!r}>"
    lay = lambda rows: mod._layout(rows, head_dim, 16)  # noqa: E731
    signature = {
        "q_desc": desc.format(mod.HALF, head_dim, lay(mod.HALF)),
        "k_desc": desc.format(full["block_n"], head_dim, lay(full["block_n"])),
        "v_desc": desc.format(full["block_n"], head_dim, lay(full["block_n"])),
        "kc_desc": desc.format(rows, head_dim, lay(full["block_n"])),
        "vc_desc": desc.format(rows, head_dim, lay(full["block_n"])),
        "out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
        "sched_ptr": "*i32", "cu_seqlens_ptr": "*i32", "seq_lens_ptr": "*i32", "tables_ptr": "*i32",
        "stride_bt": "i32", "stride_cb": "i32", "stride_ch": "i32", "qk_scale": "fp32", "num_seqs": "i32",
        "num_slots": "i32", "num_splits": "i32", "num_items": "i32", "stride_ot": "i32", "stride_oh": "i32",
    }  # fmt: skip
    constexprs = dict(GROUP=4, NUM_Q_HEADS=32, HEAD_DIM=head_dim, BLOCK_N=full["block_n"], STAGES=full["stages"],
                      PINGPONG=full["pingpong"], CONSUMER_REGS=full["consumer_regs"],
                      LOADER_REGS=full["loader_regs"], HAS_CACHE="cache_page" in cfg, PAGE=page,
                      ROWS=rows, DYNAMIC=full["dynamic"], Q_REGS=full["q_regs"],
                      SPLIT=cfg.get("splits", 1) > 1)  # fmt: skip
    signature.update({k: "constexpr" for k in constexprs})
    src = GluonASTSource(mod._prefill_gluon_kernel, signature, constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


MLA_CONFIGS = [dict(page=16, split=False), dict(page=16, split=True), dict(page=64, split=False)]
NARROW_CONFIGS = [dict(heads=16, page=16, split=False), dict(heads=16, page=16, split=True),
                  dict(heads=32, page=64, split=True), dict(heads=16, page=128, split=False),
                  dict(heads=16, page=16, split=True, fp8=True), dict(heads=32, page=16, split=False, fp8=True),
                  dict(heads=32, page=64, split=True, fp8=True), dict(heads=16, page=16, split=True, fp8=True,
                                                                      q="fp16")]


def compile_mla(mod, cfg: dict):
    """``mla_gluon``'s decode kernel at DeepSeek's dims over a bf16 cache of ``page``-row pages."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from atom.ops.triton.mla_gluon_base import smem_layout

    rows = min(cfg["page"], mod.BLOCK_N)
    desc = "tensordesc<bf16[{}, {}],{!r}>"
    signature = {
        "q_desc": desc.format(mod.HEADS, mod.COLS, smem_layout()), "c_desc": desc.format(rows, mod.COLS, smem_layout()),
        "seq_lens_ptr": "*i32", "tables_ptr": "*i32", "out_ptr": "*bf16", "part_out_ptr": "*fp32",
        "part_ml_ptr": "*fp32", "qk_scale": "fp32", "num_heads": "i32", "num_splits": "i32", "stride_tb": "i32",
        "stride_ob": "i32", "stride_oh": "i32",
    }  # fmt: skip
    constexprs = dict(PAGE=cfg["page"], ROWS=rows, SPLIT=cfg["split"], WG1_REGS=232, LOADER_REGS=24)
    signature.update({k: "constexpr" for k in constexprs})
    src = GluonASTSource(mod._mla_decode_gluon_kernel, signature, constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def compile_mla_narrow(mod, cfg: dict):
    """``mla_gluon_narrow``'s decode kernel (``heads`` as the MMA's N) over ``page``-row pages of a bf16
    cache, or of an fp8 one (``fp8``; the query ``q``: bf16, converted in the kernel, or fp16)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from atom.ops.triton.mla_gluon_base import smem_layout

    fp8, q = cfg.get("fp8", False), cfg.get("q", "bf16")
    rows = min(cfg["page"], mod.BLOCK_N)
    desc = "tensordesc<{}[{}, {}],{!r}>"
    cache = desc.format("fp8e4nv", rows, mod.COLS, smem_layout(torch.float8_e4m3fn)) if fp8 else \
        desc.format("bf16", rows, mod.COLS, smem_layout())
    signature = {
        "q_desc": desc.format(q, cfg["heads"], mod.COLS, smem_layout()),
        "c_desc": cache,
        "seq_lens_ptr": "*i32", "tables_ptr": "*i32", "k_scale_ptr": "*fp32", "out_ptr": "*bf16",
        "part_out_ptr": "*fp32", "part_ml_ptr": "*fp32", "qk_scale": "fp32", "num_heads": "i32",
        "num_splits": "i32", "stride_tb": "i32", "stride_ob": "i32", "stride_oh": "i32",
    }  # fmt: skip
    constexprs = dict(PAGE=cfg["page"], ROWS=rows, SPLIT=cfg["split"], N=cfg["heads"], LOADER_REGS=24,
                      STAGES=mod.FP8_STAGES if fp8 else mod.STAGES, FP8=fp8, HAS_SCALE=fp8,
                      CONVERT_Q=fp8 and q == "bf16")  # fmt: skip
    signature.update({k: "constexpr" for k in constexprs})
    src = GluonASTSource(mod._mla_decode_narrow_kernel, signature, constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def resources(kernel) -> tuple[int, int]:
    """Registers per thread and spill stores (bytes) of the compiled cubin, read with the
    cuobjdump that Triton bundles (the driver, which would report them, is absent here)."""
    import os
    import re
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", text).group(1))
    spills = int(re.search(r"STACK:(\d+)", text).group(1))
    return regs, spills


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--extra-site", help="site-packages providing torch (appended after Triton's)")
    ap.add_argument("--traceback", action="store_true")
    ap.add_argument("--dump", help="write the PTX of the default config here")
    ap.add_argument("--mla-only", action="store_true", help="only the MLA decode kernels")
    args = ap.parse_args()
    if args.extra_site:
        sys.path.append(args.extra_site)
    from atom.ops.triton import mla_gluon, mla_gluon_narrow
    from atom.ops.triton import prefill_attention_gluon as mod

    print(f"triton {triton.__version__}; gluon available: {mod._HAVE_GLUON}")
    bad = 0
    jobs = [(f"prefill {c}", compile_config, mod, c) for c in CONFIGS if not args.mla_only]
    jobs += [(f"mla decode {c}", compile_mla, mla_gluon, c) for c in MLA_CONFIGS]
    jobs += [(f"mla narrow {c}", compile_mla_narrow, mla_gluon_narrow, c) for c in NARROW_CONFIGS]
    for name, compile_fn, module, cfg in jobs:
        try:
            k = compile_fn(module, cfg)
        except Exception as e:  # report and go on to the next config
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[-1500:]}")
            if args.traceback:
                import traceback

                traceback.print_exception(e.__cause__ or e)
            bad += 1
            continue
        regs, spills = resources(k)
        # the kernel-wide register cap; warp_specialize moves each partition to its own count
        setmax = sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"])})
        print(f"{name}: regs={regs} (setmaxnreg {setmax}) spill_bytes={spills} smem={k.metadata.shared} "
              f"warps={k.metadata.num_warps}")  # fmt: skip
        bad += spills > 0
        if args.dump and cfg is CONFIGS[0]:
            open(args.dump, "w").write(k.asm["ptx"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
