"""Block-scaled FP8 GEMM paths at Qwen3-8B-FP8 shapes, on one GPU (under 5 minutes on an H100).

For each linear layer (N, K) and batch M, GPU time per call of:

- ``quant``: ``per_token_group_quant_fp8`` (1x128 activation groups), the step every FP8
  path below needs first (their columns exclude it);
- ``w8a8``: atom's Triton tile kernel (``w8a8_matmul`` with ``fp8_configs.gemm_config``'s tiles);
- ``skinny`` (M <= 16): the skinny kernel that ``w8a8_matmul`` now picks for few rows
  (``gemv.skinny_gemm`` with ``fp8_configs.skinny_config``);
- ``scaled_mm``: ``torch._scaled_mm`` with block-wise scales (activations 1x128 groups,
  column-major; weight 128x128 blocks, ``scale_b`` the transpose of a contiguous
  [N/128, K/128] tensor: cuBLASLt's DeepSeek recipe on sm90), when this torch accepts it (the
  error is printed otherwise);
- ``bf16``: ``F.linear`` on bf16 weights (cuBLAS).

A second table times the per-channel format (``--quantization fp8``) at M <= 16: the skinny
kernel vs ``torch._scaled_mm`` rowwise (what the FP8 layer runs there for bf16 activations).

Times are CUDA-graph replays over enough weight copies (4x L2) that no weight stays in L2
(``kernel_bench.graph_ms``). Each output is checked against its float32 reference
(``reference_fp8.w8a8_matmul`` on the same e4m3 inputs; fp32 ``F.linear`` for bf16):
``err`` = max abs difference / max abs reference. ``%bw`` = the bytes that must move (weight,
its scales, activations, output) / time / the measured copy bandwidth; ``TF`` = 2MNK / time.

    python tests/gpu/fp8_gemm_probe.py [--sweep] [--ms 1,16,4096]

``--sweep`` also times skinny candidates (modes, tiles, splits, stages) at M = 1, 4, 16 and
prints the best per shape (for ``fp8_configs.skinny_config``). Writes $OUT/fp8_gemm_probe.json
(or ./gpu-results).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, replace
from functools import partial

import torch
import torch.nn.functional as F
from kernel_bench import graph_ms  # tests/gpu/, next to this script

from atom.benchmarks.model_configs import copy_bandwidth
from atom.ops import reference_fp8
from atom.ops.triton.fp8_configs import SKINNY_MAX_ROWS, gemm_config, skinny_config
from atom.ops.triton.fp8_gemm import per_token_group_quant_fp8, w8a8_matmul
from atom.ops.triton.gemv import GemvConfig, skinny_gemm

DEV = "cuda"
BF16 = torch.bfloat16
GROUP = 128
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
MS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096, 8192)
METHODS = ("w8a8", "skinny", "scaled_mm", "bf16")


def block_scales(w_scale: torch.Tensor) -> torch.Tensor:
    """atom's row-expanded weight scales [N, groups] -> one row per 128-row block, contiguous."""
    return w_scale[::GROUP].contiguous()


# each FP8 call: (activations, their scales, one weight copy (e4m3, K-major row scales, block scales), config)
def w8a8_call(a, a_scale, c, cfg):
    return w8a8_matmul(a, a_scale, c[0], c[1], GROUP, BF16, config=cfg)


def skinny_call(a, a_scale, c, cfg):
    return skinny_gemm(a, c[0], None, cfg, (a_scale, c[1], GROUP), BF16)


def scaled_mm_call(a, a_scale, c, cfg=None):
    """``torch._scaled_mm`` with 1x128 activation and 128x128 weight scales (BlockWise1x128 x
    BlockWise128x128, inferred from the scale shapes and strides)."""
    return torch._scaled_mm(a, c[0].t(), scale_a=a_scale, scale_b=c[2].t(), out_dtype=BF16)


def sweep_candidates(n: int, k: int) -> list[GemvConfig]:
    """skinny_config's launch and its neighbours: other ways to multiply a tile and tile widths,
    no key split to twice the table's, deeper pipelines (no split), other stages and warps."""
    base = skinny_config(n, k, GROUP)
    out = []
    for mode, block_n in (("dot_t", 64), ("dot_t", 128), ("dot", 32), ("dot", 64), ("sum", 16)):
        for split in sorted({1, max(1, base.split_k // 2), base.split_k, base.split_k * 2}):
            out.append(replace(base, mode=mode, block_n=block_n, split_k=split))
    out += [replace(base, split_k=1, num_stages=8), replace(base, mode="dot", block_n=32, split_k=1, num_stages=8)]
    out += [replace(base, num_stages=s) for s in (3, 6)] + [replace(base, num_warps=8)]
    # splits (any count, not only powers of two) making the grid about one or two programs an SM (132 on
    # an H100 / H200): 48 x 4 = 192 programs (Qwen3-8B's qkv now) leave 60 SMs two and 72 one
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
    for block_n in (64, 128):
        programs = -(-n // block_n)
        for split in sorted({max(1, round(waves * sms / programs)) for waves in (1, 2)}):
            out.append(replace(base, mode="dot_t", block_n=block_n, split_k=split))
    return list(dict.fromkeys(out))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also time skinny candidates at M = 1, 4, 16")
    parser.add_argument("--ms", default=",".join(map(str, MS)), help="batch sizes, comma-separated")
    args = parser.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    t0 = time.time()
    out_dir = os.environ.get("OUT", "gpu-results")
    os.makedirs(out_dir, exist_ok=True)
    bw = copy_bandwidth()
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}: "
          f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)  # fmt: skip
    rows, errors, sweeps, channel_rows = [], {}, [], []
    for name, (n, k) in SHAPES.items():
        w_f32 = torch.randn(n, k, device=DEV) * 0.02
        channel_rows += per_channel(name, n, k, w_f32, [m for m in ms if m <= SKINNY_MAX_ROWS], l2)
        w, w_scale = reference_fp8.quantize_weight(w_f32, GROUP, GROUP)
        w_bf16 = w_f32.to(BF16)
        del w_f32
        w_scale_k = w_scale.t().contiguous().t()  # K-major, as the FP8 layers keep them
        fp8_bytes = n * k + w_scale.numel() * 4
        copies = {
            "fp8": [(w, w_scale_k, block_scales(w_scale))] + [
                (w.clone(), w_scale_k.t().clone().t(), block_scales(w_scale)) for _ in range(-(-4 * l2 // fp8_bytes))
            ],
            "bf16": [w_bf16] + [w_bf16.clone() for _ in range(-(-4 * l2 // (2 * n * k)))],
        }  # fmt: skip
        w_ref = reference_fp8.dequantize(w, w_scale, GROUP)
        for m in ms:
            x = torch.randn(m, k, device=DEV, dtype=BF16)
            a, a_scale = per_token_group_quant_fp8(x, GROUP)
            ref = reference_fp8.dequantize(a, a_scale, GROUP) @ w_ref.t()
            calls = {"w8a8": (w8a8_call, gemm_config(m, n, k, True)), "scaled_mm": (scaled_mm_call, None)}
            if m <= SKINNY_MAX_ROWS:
                calls["skinny"] = (skinny_call, skinny_config(n, k, GROUP))
            row = {"layer": name, "n": n, "k": k, "m": m}
            fp8_moved = fp8_bytes + m * k * (1 + 4 / GROUP) + m * n * 2
            row["quant_us"] = graph_ms([partial(per_token_group_quant_fp8, x, GROUP)]) * 1e3
            for method, (fn, cfg) in calls.items():
                try:
                    row[f"{method}_err"] = rel_err(fn(a, a_scale, copies["fp8"][0], cfg), ref)
                    us = graph_ms([partial(fn, a, a_scale, c, cfg) for c in copies["fp8"]]) * 1e3
                except Exception as e:  # a call this torch / Triton rejects: printed once below
                    errors.setdefault(f"{method}: {type(e).__name__}: {str(e)[:400]}", []).append(f"{name} m={m}")
                    continue
                row[f"{method}_us"] = us
                row[f"{method}_bw"] = fp8_moved / (us * 1e-6) / bw
            row["bf16_err"] = rel_err(F.linear(x, w_bf16), x.float() @ w_bf16.float().t())
            row["bf16_us"] = graph_ms([partial(F.linear, x, c) for c in copies["bf16"]]) * 1e3
            row["bf16_bw"] = (2 * n * k + 2 * m * k + 2 * m * n) / (row["bf16_us"] * 1e-6) / bw
            rows.append(row)
            print(f"{name} m={m}: " + ", ".join(f"{meth} {row[f'{meth}_us']:.1f}" for meth in METHODS
                                                if f"{meth}_us" in row) + f" us ({time.time() - t0:.0f} s)",
                  flush=True)  # fmt: skip
            if args.sweep and m in (1, 4, 16):
                sweeps.append(sweep(name, n, k, m, a, a_scale, ref, copies["fp8"], fp8_moved, bw))
        del copies, w_ref
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "fp8_gemm_probe.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                   "copy_bw": bw, "rows": rows, "errors": errors, "sweeps": sweeps, "per_channel": channel_rows},
                  f, indent=1)  # fmt: skip
    for msg, where in errors.items():
        print(f"\nFAILED ({len(where)} cases, first {where[0]}): {msg}")
    print_table(rows, bw)
    print("\nper-channel weights, per-token activations (--quantization fp8): us per call, err\n")
    print("| layer | M | skinny | _scaled_mm rowwise | err skinny/rowwise |\n|---|---:|---:|---:|---|")
    for r in channel_rows:
        print(f"| {r['layer']} | {r['m']} | {r['skinny_us']:.1f} | {r['rowwise_us']:.1f} | "
              f"{r['skinny_err']:.0e}/{r['rowwise_err']:.0e} |")  # fmt: skip
    for s in sweeps:
        b = s["configs"][0] if s["configs"] else None
        print(f"sweep {s['layer']} m={s['m']}: table {s['table_us']:.1f} us; best "
              + (f"{b['us']:.1f} us {b['cfg']}" if b else "none"))  # fmt: skip
    print(f"\n{time.time() - t0:.0f} s")


def per_channel(name: str, n: int, k: int, w_f32: torch.Tensor, ms: list[int], l2: int) -> list[dict]:
    """The per-channel format at decode sizes: the skinny kernel (``w8a8_matmul``'s choice up
    to 16 rows) vs ``torch._scaled_mm`` rowwise, which the FP8 layer runs for bf16 activations."""
    w, w_scale = reference_fp8.quantize_weight(w_f32)
    copies = [(w, w_scale)] + [(w.clone(), w_scale.clone()) for _ in range(-(-4 * l2 // (n * k)))]
    w_ref = reference_fp8.dequantize(w, w_scale, 0)
    cfg = skinny_config(n, k, 0)
    rows = []
    for m in ms:
        a, a_scale = per_token_group_quant_fp8(torch.randn(m, k, device=DEV, dtype=BF16), 0)
        ref = reference_fp8.dequantize(a, a_scale, 0) @ w_ref.t()
        row = {"layer": name, "m": m}
        for method, fn in (("skinny", channel_skinny_call), ("rowwise", channel_rowwise_call)):
            row[f"{method}_err"] = rel_err(fn(a, a_scale, copies[0], cfg), ref)
            row[f"{method}_us"] = graph_ms([partial(fn, a, a_scale, c, cfg) for c in copies]) * 1e3
        rows.append(row)
    return rows


def channel_skinny_call(a, a_scale, c, cfg):
    return skinny_gemm(a, c[0], None, cfg, (a_scale, c[1], 0), BF16)


def channel_rowwise_call(a, a_scale, c, cfg=None):
    return torch._scaled_mm(a, c[0].t(), scale_a=a_scale, scale_b=c[1].t(), out_dtype=BF16)


def sweep(name, n, k, m, a, a_scale, ref, copies, moved, bw) -> dict:
    table = skinny_config(n, k, GROUP)
    configs = []
    for cfg in sweep_candidates(n, k):
        try:
            err = rel_err(skinny_call(a, a_scale, copies[0], cfg), ref)
            us = graph_ms([partial(skinny_call, a, a_scale, c, cfg) for c in copies])
        except Exception as e:  # e.g. out of shared memory
            configs.append({"cfg": asdict(cfg), "error": repr(e)[:200]})
            continue
        configs.append({"cfg": asdict(cfg), "us": us * 1e3, "bw": moved / (us * 1e-3) / bw, "err": err})
    timed = sorted((c for c in configs if "us" in c and c["err"] < 2e-2), key=lambda c: c["us"])
    table_us = next((c["us"] for c in timed if c["cfg"] == asdict(table)), float("nan"))
    return {"layer": name, "m": m, "table_us": table_us, "configs": timed + [c for c in configs if c not in timed]}


def print_table(rows: list[dict], bw: float) -> None:
    print(f"\nus per call (%bw of {bw / 1e12:.2f} TB/s copy | TFLOP/s); err = max abs diff / max abs ref\n")
    print("| layer | M | quant | " + " | ".join(METHODS) + " | err " + "/".join(METHODS) + " |")
    print("|---|---:|---:|" + "---:|" * len(METHODS) + "---|")
    for r in rows:
        flops = 2 * r["m"] * r["n"] * r["k"]
        cells = []
        for meth in METHODS:
            us = r.get(f"{meth}_us")
            cells.append("-" if us is None else f"{us:.1f} ({100 * r[f'{meth}_bw']:.0f}% \\| {flops / us / 1e6:.0f})")
        errs = "/".join("-" if f"{meth}_err" not in r else f"{r[f'{meth}_err']:.0e}" for meth in METHODS)
        print(f"| {r['layer']} | {r['m']} | {r['quant_us']:.1f} | " + " | ".join(cells) + f" | {errs} |")


if __name__ == "__main__":
    main()
