"""Batch-1 decode's kernel chain without attention, bf16 against FP8 weights: where the FP8 layer's time goes
beyond its GEMMs.

Qwen3-8B's layer minus attention, one row, bf16 and FP8 (block-128) weights: RMS norm -> qkv -> o (on the
first 4,096 of qkv's columns) -> RMS norm -> gate_up -> SiLU-mul -> down, over 8 layers of their own weights
(past L2), captured in one CUDA graph and replayed: us a layer and the weight bytes / time as a share of
the copy bandwidth measured in the same call. ``fp8_gemm_probe.py`` times the same GEMMs one by one.

    python tests/gpu/decode_chain.py [--layers 8]

Writes $OUT/decode_chain.json (or ./gpu-results).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from kernel_bench import bench_ms  # tests/gpu/, next to this script

from atom import ops
from atom.benchmarks.model_configs import copy_bandwidth
from atom.ops import reference_fp8
from atom.ops.triton import gemv
from atom.ops.triton.fp8_gemm import fp8_linear

DEV = "cuda"
HIDDEN, QKV, INTER = 4096, 6144, 12288


def layer_weights(fp8: bool) -> tuple[list, int]:
    """One layer's four linears as callables, and their weight bytes."""
    calls, nbytes = [], 0
    for n, k in [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]:
        w = torch.randn(n, k, device=DEV) / k**0.5
        if fp8:
            q, s = reference_fp8.quantize_weight(w, 128, 128)
            s = s.t().contiguous().t()  # K-major, as the FP8 layers keep them
            calls.append(lambda x, q=q, s=s: fp8_linear(x, q, s, 128))
            nbytes += q.numel() + s.numel() * 4
        else:
            w16 = w.to(torch.bfloat16)
            calls.append(lambda x, w16=w16: gemv.linear(x, w16))
            nbytes += w16.numel() * 2
    return calls, nbytes


def chain(x, layers, norm_w):
    for qkv, o, gate_up, down in layers:
        h = o(qkv(ops.rms_norm(x, norm_w, 1e-6))[:, :HIDDEN])
        x = down(ops.silu_and_mul(gate_up(ops.rms_norm(h, norm_w, 1e-6))))
    return x


def timed(layers, norm_w, x) -> float:
    chain(x, layers, norm_w)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(x, layers, norm_w)
    return bench_ms(graph.replay, 50) / len(layers)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    bw = copy_bandwidth()
    norm_w = torch.rand(HIDDEN, device=DEV, dtype=torch.bfloat16) + 0.5
    x = torch.randn(1, HIDDEN, device=DEV, dtype=torch.bfloat16)
    rows = []
    for fp8 in (False, True):
        built = [layer_weights(fp8) for _ in range(args.layers)]
        ms = timed([c for c, _ in built], norm_w, x)
        rows.append(dict(weights="fp8" if fp8 else "bf16", us=ms * 1e3, floor_pct=100 * built[0][1] / (ms * 1e-3) / bw))
        print(rows[-1], flush=True)
        del built
        torch.cuda.empty_cache()
    out_dir = os.environ.get("OUT", "gpu-results")
    os.makedirs(out_dir, exist_ok=True)
    json.dump(dict(device=torch.cuda.get_device_name(), copy_tbps=bw / 1e12, rows=rows),
              open(f"{out_dir}/decode_chain.json", "w"), indent=1)  # fmt: skip
    print(f"\n{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s; Qwen3-8B layer minus attention, 1 row\n")
    print("| weights | us / layer | % of the copy floor |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['weights']} | {r['us']:.1f} | {r['floor_pct']:.0f}% |")


if __name__ == "__main__":
    main()
