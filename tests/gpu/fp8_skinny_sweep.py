"""The FP8 decode GEMM as the FP8 layer calls it (``fp8_gemm.fp8_linear``: bf16 activations
quantised in the kernel, 128x128 block-scaled e4m3 weights), at Qwen3-8B-FP8 shapes and a few
rows: ``skinny_config``'s launch against the ``groups`` mode's candidates (several scale groups
a key step, summed on the CUDA cores), on one GPU (~4 minutes on an H100).

Times are CUDA-graph replays over enough weight copies (4x L2) that no weight stays in L2;
``%bw`` = weight + scale bytes / time / the copy bandwidth measured in the same call. Every
candidate's output is checked against the reference (``reference_fp8.fp8_linear``).

    python tests/gpu/fp8_skinny_sweep.py [--ms 1,2,4]

Prints the table's and the best candidate's time per shape and row count; writes
$OUT/fp8_skinny_sweep.json (or ./gpu-results).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from dataclasses import asdict
from functools import partial

import torch
from kernel_bench import graph_ms  # tests/gpu/, next to this script

from atom.benchmarks.model_configs import copy_bandwidth
from atom.ops import reference_fp8
from atom.ops.triton.fp8_configs import skinny_config
from atom.ops.triton.gemv import GemvConfig, skinny_gemm

DEV, BF16, GROUP = "cuda", torch.bfloat16, 128
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def candidates() -> list[GemvConfig]:
    out = []
    for block_n, block_k, warps, stages in itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8), (3, 4)):
        if block_n * block_k <= 16384:  # float32 copies of the weight tile stay in registers
            out.append(GemvConfig(block_n=block_n, block_k=block_k, mode="groups", num_warps=warps, num_stages=stages))
    return out


def call(x, c, cfg):
    return skinny_gemm(x, c[0], None, cfg, (None, c[1], GROUP), BF16)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="1,2,4")
    args = p.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    t0, bw = time.time(), copy_bandwidth()
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    results = []
    for name, (n, k) in SHAPES.items():
        w, w_scale = reference_fp8.quantize_weight(torch.randn(n, k, device=DEV) * 0.02, GROUP, GROUP)
        w_scale = w_scale.t().contiguous().t()  # K-major, as the FP8 layers keep them
        nbytes = n * k + w_scale.numel() * 4
        copies = [(w, w_scale)] + [(w.clone(), w_scale.t().clone().t()) for _ in range(-(-4 * l2 // nbytes))]
        for m in ms:
            x = torch.randn(m, k, device=DEV, dtype=BF16)
            ref = reference_fp8.fp8_linear(x, w, w_scale, GROUP).float()
            res = {"layer": name, "m": m, "configs": []}
            launches = [("table", skinny_config(m, n, k, GROUP)), ("mma", skinny_config(16, n, k, GROUP))]
            for label, cfg in launches + [("cand", c) for c in candidates()]:
                try:
                    out = call(x, copies[0], cfg).float()
                    err = ((out - ref).abs().max() / ref.abs().max()).item()
                    us = graph_ms([partial(call, x, c, cfg) for c in copies]) * 1e3
                except Exception as e:  # e.g. out of registers / shared memory
                    res["configs"].append({"label": label, "cfg": asdict(cfg), "error": repr(e)[:200]})
                    continue
                res["configs"].append({"label": label, "cfg": asdict(cfg), "us": us, "bw": nbytes / (us * 1e-6) / bw,
                                       "err": err})  # fmt: skip
            ok = sorted((c for c in res["configs"] if "us" in c and c["err"] < 2e-2), key=lambda c: c["us"])
            for label in ("table", "mma"):
                res[label] = next(c for c in res["configs"] if c["label"] == label)
            res["best"] = ok[0] if ok else None
            results.append(res)
            b, t, mma = res["best"], res["table"], res["mma"]
            print(f"{name} m={m}: table {t.get('us', float('nan')):.1f} us, mma {mma.get('us', float('nan')):.1f} us, "
                  f"best {b['us']:.1f} us ({100 * b['bw']:.0f}%) {b['cfg']} ({time.time() - t0:.0f} s)",
                  flush=True)  # fmt: skip
        del copies
        torch.cuda.empty_cache()
    out_dir = os.environ.get("OUT", "gpu-results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "fp8_skinny_sweep.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "results": results}, f, indent=1)
    # the candidate with the lowest total time over the four layers, per row count
    print("\n| M | table us (4 layers) | mma us | best single config | its us | per-layer best us |\n"
          "|---|---:|---:|---|---:|---:|")
    for m in ms:
        rs = [r for r in results if r["m"] == m]
        totals: dict[str, float] = {}
        for r in rs:
            for c in r["configs"]:
                if c["label"] == "cand" and "us" in c and c["err"] < 2e-2:
                    totals[json.dumps(c["cfg"])] = totals.get(json.dumps(c["cfg"]), 0.0) + c["us"]
        full = {cfg: t for cfg, t in totals.items() if all(
            any(json.dumps(c["cfg"]) == cfg and "us" in c for c in r["configs"]) for r in rs)}
        best = min(full, key=full.get) if full else None
        table = sum(r["table"].get("us", float("nan")) for r in rs)
        mma = sum(r["mma"].get("us", float("nan")) for r in rs)
        print(f"| {m} | {table:.1f} | {mma:.1f} | {best} | {full.get(best, float('nan')):.1f} | "
              f"{sum(r['best']['us'] for r in rs if r['best']):.1f} |")
    print(f"\n{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
