"""FP8 kernel timings on one GPU (Qwen3-8B / Qwen3-30B-A3B shapes), printed as a table and
written to $OUT/fp8_bench.json (or ./gpu-results):

- GEMM: bf16 ``torch.mm`` vs atom's Triton w8a8 GEMM (block 128x128 and per-channel, the
  activation quantisation included) vs ``torch._scaled_mm`` rowwise (quantisation included);
- decode attention over a bf16 vs an fp8 KV cache, and MLA decode over a bf16 vs an fp8 latent
  cache (DeepSeek-V3: rank 512 + rope 64; 128 heads at -tp 1, 16 at -tp 8);
- fused MoE bf16 vs FP8 (block 128 and per-channel).

    python tests/gpu/fp8_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from fp8_sweep import us as graph_us  # tests/gpu/, next to this script

from atom.ops import reference, reference_fp8
from atom.ops.triton import fused_moe, mla_decode, paged_attention
from atom.ops.triton.fp8_gemm import per_token_group_quant_fp8, w8a8_matmul
from atom.ops.triton.moe_fp8 import fused_moe_fp8

DEV = "cuda"
FP8 = torch.float8_e4m3fn


def us(fn, *args) -> float:
    """GPU microseconds per call of ``fn(*args)`` inside a CUDA graph, L2 flushed before each
    call (``fp8_sweep.us``; ``do_bench`` would also time the Python launches, which dominate
    at decode sizes)."""
    return graph_us(lambda: fn(*args))


def w8a8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, group_k: int) -> torch.Tensor:
    return w8a8_matmul(*per_token_group_quant_fp8(x, group_k), w, scale, group_k, torch.bfloat16)


def scaled_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    a, a_scale = per_token_group_quant_fp8(x, 0)
    return torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=scale.t(), out_dtype=torch.bfloat16)


def gemm_rows(ms: list[int]) -> list[dict]:
    rows = []
    for n, k, name in [(6144, 4096, "qkv"), (4096, 4096, "o"), (24576, 4096, "gate_up"), (4096, 12288, "down")]:
        w_bf16 = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
        w_blk, s_blk = reference_fp8.quantize_weight(w_bf16, 128, 128)
        w_ch, s_ch = reference_fp8.quantize_weight(w_bf16)
        for m in ms:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            rows.append(dict(
                op=f"gemm {name}", m=m, n=n, k=k,
                bf16_us=us(torch.mm, x, w_bf16.t()),
                triton_block_us=us(w8a8, x, w_blk, s_blk, 128),
                triton_channel_us=us(w8a8, x, w_ch, s_ch, 0),
                scaled_mm_us=us(scaled_mm, x, w_ch, s_ch),
                quant_us=us(per_token_group_quant_fp8, x, 128),
            ))
    return rows


def attention_rows(cases: list[tuple[int, int]]) -> list[dict]:
    hq, hk, d, bs = 32, 8, 128, 16
    rows = []
    for batch, ctx in cases:
        blocks = -(-(ctx + 1) // bs)
        tables = torch.arange(batch * blocks, dtype=torch.int32, device=DEV).view(batch, blocks)
        k16 = torch.randn(batch * blocks, hk, bs, d, device=DEV, dtype=torch.bfloat16)
        v16 = torch.randn_like(k16)
        k8, v8 = k16.to(FP8), v16.to(FP8)
        one = torch.ones(1, device=DEV)
        q = torch.randn(batch, hq, d, device=DEV, dtype=torch.bfloat16)
        cu = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
        lens = torch.full((batch,), ctx + 1, dtype=torch.int32, device=DEV)
        meta = (cu, lens, tables, d**-0.5, 1, ctx + 1, 0, None, None)
        rows.append(dict(
            op="decode attention", batch=batch, ctx=ctx,
            bf16_us=us(paged_attention, q, k16, v16, *meta),
            fp8_us=us(paged_attention, q, k8, v8, *meta, one, one),
        ))
    return rows


def mla_rows(cases: list[tuple[int, int]]) -> list[dict]:
    rank, rope, bs = 512, 64, 16
    rows = []
    for heads in (128, 16):
        for batch, ctx in cases:
            blocks = -(-(ctx + 1) // bs)
            tables = torch.arange(batch * blocks, dtype=torch.int32, device=DEV).view(batch, blocks)
            c16 = torch.randn(batch * blocks, bs, rank + rope, device=DEV, dtype=torch.bfloat16)
            q = torch.randn(batch, heads, rank + rope, device=DEV, dtype=torch.bfloat16)
            lens = torch.full((batch,), ctx + 1, dtype=torch.int32, device=DEV)
            rows.append(dict(
                op="mla decode", heads=heads, batch=batch, ctx=ctx,
                bf16_us=us(mla_decode, q, c16, lens, tables, 192**-0.5, rank),
                fp8_us=us(mla_decode, q, c16.to(FP8), lens, tables, 192**-0.5, rank, torch.ones(1, device=DEV)),
            ))
    return rows


def moe_rows(token_counts: list[int]) -> list[dict]:
    hidden, inter, experts, top_k = 2048, 768, 128, 8
    w13 = torch.randn(experts, 2 * inter, hidden, device=DEV, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=DEV, dtype=torch.bfloat16) * 0.02
    quant = {}
    for g in (128, 0):
        q13 = [reference_fp8.quantize_weight(w13[e], g, g or 1) for e in range(experts)]
        q2 = [reference_fp8.quantize_weight(w2[e], g, g or 1) for e in range(experts)]
        quant[g] = (torch.stack([q for q, _ in q13]), torch.stack([s for _, s in q13]),
                    torch.stack([q for q, _ in q2]), torch.stack([s for _, s in q2]))
    rows = []
    for t in token_counts:
        x = torch.randn(t, hidden, device=DEV, dtype=torch.bfloat16)
        weights, ids = reference.moe_topk(torch.randn(t, experts, device=DEV), top_k, True)
        rows.append(dict(
            op="fused moe", tokens=t,
            bf16_us=us(fused_moe, x, w13, w2, weights, ids),
            fp8_block_us=us(fused_moe_fp8, x, *quant[128], weights, ids, 128),
            fp8_channel_us=us(fused_moe_fp8, x, *quant[0], weights, ids, 0),
        ))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes")
    args = parser.parse_args()
    ms = [1, 64, 1024] if args.quick else [1, 16, 64, 256, 1024, 4096]
    att = [(1, 8192), (64, 2048)] if args.quick else [(1, 2048), (1, 8192), (8, 4096), (64, 2048), (256, 1024)]
    toks = [1, 256] if args.quick else [1, 16, 256, 2048]
    rows = gemm_rows(ms) + attention_rows(att) + mla_rows(att) + moe_rows(toks)
    out = os.environ.get("OUT") or "gpu-results"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "fp8_bench.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"device: {torch.cuda.get_device_name()}")
    for r in rows:
        print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
