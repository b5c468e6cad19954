"""Prefill attention variants timed against the current default, one GPU call (issue 13).

    python tests/gpu/prefill_sweep.py [--out DIR] [--budget-s 130]

Cases are the issue's prefill shapes at Qwen3-8B heads (32 q / 8 kv, head_dim 128, bf16, block
size 16), with the chunk's own K/V passed packed as the engine passes them. Variants are configs
of ``atom.ops.triton.prefill_attention`` (tile shape, ``splits``: key-range segments); ``default``
is what ``paged_attention`` picks for a batch of only these chunks. Each row: device time
(CUDA-graph replays over enough input copies to defeat L2, median), TFLOP/s and its share of the
bf16 torch.mm rate measured in the same call, speed-up over the default, and max abs difference
from the default's output (the default itself is checked against the reference by
tests/gpu/test_kernels_gpu.py). Variants that fail to compile or run are reported and skipped.
Writes ``prefill_sweep.json`` under ``--out`` (default: $OUT or .).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import time

import torch
import triton
from kernel_bench import graph_ms  # this folder: python tests/gpu/prefill_sweep.py

from atom.ops.triton.prefill_attention import prefill_attention

DEV = "cuda"
SCALE = 128**-0.5 * 1.4426950408889634  # head_dim 128; the kernel takes log2(e) folded in

# (q_lens, context) per sequence: the cases plus the short chunk over a long prefix
CASES = {
    "q=2048": ([2048], 0),
    "q=8192": ([8192], 0),
    "8x q=2048": ([2048] * 8, 0),
    "q=2048 ctx=6144": ([2048], 6144),
    "4x q=512 ctx=4096": ([512] * 4, 4096),
    "q=512 ctx=4096": ([512], 4096),
}


def _cfg(m, n, w, s, reg=None, **extra):
    return dict(block_m=m, block_n=n, num_warps=w, num_stages=s, **({"maxnreg": reg} if reg else {}), **extra)


# name: config (None = the default pick); split-K variants only run where there is a cached prefix.
# Measured and removed (2026-11-23, H100, Triton 3.6; commit 34f0cdd has them): packed K/V through
# on-device descriptors (2-3% slower than host-built ones), the packed loop warp-specialised
# (0.60-0.96x of the default at every tile shape), and the next tile's Q @ K^T issued before this
# tile's softmax (0.57-0.89x: a second score tile costs the second program per SM).
SPLIT_BASE = {"m64n64w4s3": _cfg(64, 64, 4, 3), "m128n64w8s2 r128": _cfg(128, 64, 8, 2, 128)}
VARIANTS = {
    "default": None,
    "m128n64w8s2 r128": SPLIT_BASE["m128n64w8s2 r128"],
    "m64n64w4s3": SPLIT_BASE["m64n64w4s3"],
    **{f"{name} split{s}": {**cfg, "splits": s} for name, cfg in SPLIT_BASE.items() for s in (2, 3, 4)},
}


def gemm_tflops(n: int = 8192) -> float:
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")
    return 2 * n**3 / ms / 1e9


def make_inputs(q_lens, ctx, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16):
    """One input set: q, caches with scattered blocks, metadata, and the chunk's K/V packed."""
    seq_lens = [ctx + n for n in q_lens]
    max_blocks = -(-max(seq_lens) // block_size)
    tables = torch.randperm(len(q_lens) * max_blocks, dtype=torch.int32, device=DEV).view(len(q_lens), -1)
    k_cache = torch.randn(len(q_lens) * max_blocks, num_kv_heads, block_size, head_dim, dtype=torch.bfloat16,
                          device=DEV)  # fmt: skip
    v_cache = torch.randn_like(k_cache)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEV)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, dtype=torch.bfloat16, device=DEV)
    pos = torch.cat([torch.arange(ctx, ctx + n, device=DEV) for n in q_lens])
    seq = torch.repeat_interleave(torch.arange(len(q_lens), device=DEV), torch.tensor(q_lens, device=DEV))
    slots, offs = tables[seq, pos // block_size].long(), pos % block_size
    k, v = k_cache[slots, :, offs], v_cache[slots, :, offs]
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    return (q, torch.empty_like(q), k_cache, v_cache, cu, lens, tables), dict(k=k, v=v)


def flops(q_lens, ctx, num_q_heads=32, head_dim=128) -> int:
    visible = sum(n * ctx + n * (n + 1) // 2 for n in q_lens)
    return 4 * num_q_heads * head_dim * visible


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget-s", type=float, default=130.0, help="stop starting new rows after this")
    args = parser.parse_args()
    start = time.monotonic()
    tf = gemm_tflops()
    print(f"{torch.cuda.get_device_name()}: bf16 torch.mm {tf:.0f} TFLOP/s; triton {triton.__version__}", flush=True)
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    inputs = {}
    for case, (q_lens, ctx) in CASES.items():
        one_bytes = sum(q_lens) * 32 * 128 * 2 * 4 + (ctx + max(q_lens)) * len(q_lens) * 8 * 128 * 2 * 2
        inputs[case] = [make_inputs(q_lens, ctx) for _ in range(min(32, max(1, -(-4 * l2 // one_bytes))))]
    rows, expect = [], {}
    # variants outer, so each compiles once and a spent budget cuts the least likely variants
    for name, cfg in VARIANTS.items():
        for case, (q_lens, ctx) in CASES.items():
            if cfg and cfg.get("splits", 1) > 1 and not ctx:
                continue
            if time.monotonic() - start > args.budget_s:
                print(f"  budget spent: skipping {case} {name}", flush=True)
                continue
            copies = inputs[case]
            try:
                max_k = ctx + max(q_lens)
                fns = [
                    functools.partial(prefill_attention, *a, SCALE, cfg, **kv, max_seqlen_k=max_k) for a, kv in copies
                ]
                copies[0][0][1].fill_(float("nan"))  # every element must be written
                kernel = fns[0]()
                out = copies[0][0][1].float()
                expect.setdefault(case, out)
                ms = graph_ms(fns)
                diff = (out - expect[case]).abs().max().item()
                row = dict(case=case, variant=name, config=cfg, ms=ms, tflops=flops(q_lens, ctx) / ms / 1e9, diff=diff)
                row.update(nan=bool(out.isnan().any()), regs=kernel.n_regs, spills=kernel.n_spills)
                rows.append(row)
                print(f"  {case:<18} {name:<28} {ms:8.4f} ms {row['tflops']:6.1f} TF diff {diff:.4f} "
                      f"regs {kernel.n_regs} spills {kernel.n_spills}", flush=True)  # fmt: skip
            except Exception as e:  # a variant that cannot compile or run here: report, go on
                print(f"  {case:<18} {name:<28} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                rows.append(dict(case=case, variant=name, config=cfg, error=f"{type(e).__name__}: {str(e)[:2000]}"))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prefill_sweep.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), gemm_tflops=tf, rows=rows), f, indent=1)
    print(f"\nbest per case (x = default ms / ms; %mm of {tf:.0f} TFLOP/s bf16 torch.mm):")
    print(f"{'case':<18} {'variant':<30} {'ms':>8} {'TF/s':>6} {'%mm':>4} {'x':>5} {'diff':>6}")
    for case in CASES:
        ok = [r for r in rows if r["case"] == case and "ms" in r and not r["nan"] and r["diff"] < 0.02]
        base = next((r for r in ok if r["variant"] == "default"), None)
        best = sorted(ok, key=lambda r: r["ms"])[:3]
        for r in best + ([base] if base and base not in best else []):
            x = base["ms"] / r["ms"] if base else float("nan")
            print(f"{case:<18} {r['variant']:<30} {r['ms']:8.4f} {r['tflops']:6.1f} {100 * r['tflops'] / tf:3.0f}% "
                  f"{x:5.2f} {r['diff']:6.4f}")  # fmt: skip
    print(f"total {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
