"""Skinny GEMM (atom.ops.triton.gemv) vs torch (cuBLAS) at decode shapes, on one GPU.

For each Qwen3-8B / Qwen3-0.6B projection and m rows: the error of every configuration
against an fp32 product, and its time per call from a CUDA-graph replay that cycles over
enough copies of the weight (>= 320 MB) that none is still in L2; the copy bandwidth of a
1 GiB ``copy_`` measured in the same run gives the floor (weight bytes / bandwidth).
Writes $OUT/gemv_bench.json (or ./gpu-results) and prints a table last.

    python tests/gpu/gemv_bench.py [--budget-s 120] [--rows 1,2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F
import triton

from atom.ops.triton.gemv import GemvConfig, pick_config, skinny_gemm

DEV = "cuda"
SHAPES = {  # name: (N, K)
    "8b.qkv": (6144, 4096),
    "8b.o": (4096, 4096),
    "8b.gate_up": (24576, 4096),
    "8b.down": (4096, 12288),
    "8b.lm_head": (151936, 4096),
    "0.6b.qkv": (4096, 1024),
    "0.6b.o": (1024, 2048),
    "0.6b.gate_up": (6144, 1024),
    "0.6b.down": (1024, 3072),
    "7b.qkv": (4608, 3584),
    "7b.o": (3584, 3584),
    "7b.gate_up": (37888, 3584),
    "7b.down": (3584, 18944),
}
M_ORDER = (1, 16, 8, 4, 2, 32)  # most important first, in case the budget runs out
C = GemvConfig


def candidates(m: int, k: int) -> list[GemvConfig]:
    if m <= 2:  # a grid of the sum mode's tiles, warps and stages (cheap: ~40 s at one row on an H200)
        grid = [C(bn, bk, num_warps=w, num_stages=st) for bn, bk, w, st in
                itertools.product((1, 2, 4, 8), (512, 1024, 2048), (2, 4, 8), (1, 2, 3))
                if bk <= triton.next_power_of_2(k) and bn * bk <= 8192]  # fmt: skip
        return grid + [C(8, 256, mode="defer"), C(4, 512, mode="defer"), C(16, 256, mode="dot")]
    if m <= 8:
        return [
            C(8, 128, num_stages=3), C(8, 256, num_warps=8, num_stages=3), C(16, 128, num_warps=8),
            C(16, 256, mode="dot", num_stages=3), C(32, 128, mode="dot", num_stages=4), C(16, 512, mode="dot"),
        ]  # fmt: skip
    return [
        C(16, 256, mode="dot", num_stages=3), C(32, 128, mode="dot", num_stages=4), C(32, 256, mode="dot"),
        C(64, 128, mode="dot", num_stages=4), C(16, 512, mode="dot", num_warps=8), C(8, 128, num_warps=8),
    ]  # fmt: skip


def with_splits(cfg: GemvConfig, n: int, k: int) -> list[GemvConfig]:
    """The configuration, plus split-K variants where N alone makes fewer than ~4 programs per SM."""
    programs = -(-n // cfg.block_n)
    out = [cfg]
    for split in (2, 4, 8):
        if programs * split <= 4 * 132 * 2 and k // split >= cfg.block_k and programs < 4 * 132:
            out.append(GemvConfig(cfg.block_n, cfg.block_k, split, cfg.mode, cfg.num_warps, cfg.num_stages))
    return out


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    del src, dst
    return 2 * (1 << 30) * 10 / (start.elapsed_time(end) / 1e3)


def graph_us(fn, weights: list[torch.Tensor], replays: int = 4) -> float:
    """Microseconds per call of ``fn(w)`` in a CUDA graph that calls it once per weight copy."""
    for w in weights[:2]:
        fn(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(weights))


def measure(name: str, n: int, k: int, m: int, ws: list[torch.Tensor], bw: float, failures: list) -> dict | None:
    """One shape at m rows: torch, every candidate configuration and ``pick_config``'s."""
    x = torch.randn(m, k, device=DEV, dtype=ws[0].dtype)
    ref = F.linear(x.float(), ws[0].float())
    row = {"shape": name, "n": n, "k": k, "m": m, "floor_us": n * k * 2 / bw * 1e6}
    row["torch_us"] = graph_us(lambda w: F.linear(x, w), ws)
    configs = []
    for base in candidates(m, k):
        for cfg in with_splits(base, n, k):
            try:
                out = skinny_gemm(x, ws[0], None, cfg)
                err = (out.float() - ref).abs().max().item() / max(1.0, ref.abs().max().item())
                us = graph_us(lambda w, cfg=cfg: skinny_gemm(x, w, None, cfg), ws)
            except Exception as e:  # a configuration the compiler rejects (e.g. out of resources)
                failures.append({"shape": name, "m": m, "cfg": asdict(cfg), "error": repr(e)[:300]})
                continue
            if not err <= 2e-2:
                failures.append({"shape": name, "m": m, "cfg": asdict(cfg), "err": err})
            configs.append({"cfg": asdict(cfg), "us": us, "err": err})
    if not configs:
        return None
    pick = pick_config(m, n, k)
    row["pick"] = asdict(pick)
    try:
        row["pick_us"] = graph_us(lambda w: skinny_gemm(x, w, None, pick), ws)
    except Exception as e:
        failures.append({"shape": name, "m": m, "cfg": asdict(pick), "error": repr(e)[:300]})
        row["pick_us"] = float("nan")
    row["configs"] = sorted(configs, key=lambda c: c["us"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-s", type=float, default=120.0)
    parser.add_argument("--rows", default=",".join(map(str, M_ORDER)), help="row counts, most important first")
    args = parser.parse_args()
    t0 = time.time()
    out_dir = os.environ.get("OUT", "gpu-results")
    os.makedirs(out_dir, exist_ok=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s on {torch.cuda.get_device_name()}", flush=True)
    dtype = torch.bfloat16
    weights = {}
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-320_000_000 // (n * k * 2)))
        weights[name] = [torch.randn(n, k, device=DEV, dtype=dtype) / k**0.5 for _ in range(copies)]
    results, failures, skipped = [], [], []
    for m in map(int, args.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            if time.time() - t0 > args.budget_s:
                skipped.append((name, m))
                continue
            row = measure(name, n, k, m, weights[name], bw, failures)
            if row is None:
                continue
            results.append(row)
            best = row["configs"][0]
            print(f"{name} m={m} torch {row['torch_us']:.1f} best {best['us']:.1f} {best['cfg']} "
                  f"({time.time() - t0:.0f}s)", flush=True)  # fmt: skip
    with open(os.path.join(out_dir, "gemv_bench.json"), "w") as f:
        json.dump({"copy_bw": bw, "device": torch.cuda.get_device_name(), "results": results,
                   "failures": failures, "skipped": skipped}, f, indent=1)  # fmt: skip
    print(f"\ncorrectness: {len(failures)} failing configs; skipped (budget): {skipped}")
    for fail in failures[:5]:
        print("FAIL", fail)
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s; % = floor (weight bytes / copy bw) / time")
    print(f"{'shape':<14}{'m':>3}{'floor':>8}{'torch':>9}{'%':>5}{'best':>9}{'%':>5}{'pick':>9}{'%':>5}  best config")
    for r in sorted(results, key=lambda r: (r["shape"], r["m"])):
        b = r["configs"][0]
        c = b["cfg"]
        desc = f"{c['mode']} n{c['block_n']} k{c['block_k']} s{c['split_k']} w{c['num_warps']} st{c['num_stages']}"
        pct = [100 * r["floor_us"] / t for t in (r["torch_us"], b["us"], r["pick_us"])]
        print(f"{r['shape']:<14}{r['m']:>3}{r['floor_us']:>8.1f}{r['torch_us']:>9.1f}{pct[0]:>5.0f}"
              f"{b['us']:>9.1f}{pct[1]:>5.0f}{r['pick_us']:>9.1f}{pct[2]:>5.0f}  {desc}")  # fmt: skip


if __name__ == "__main__":
    main()
