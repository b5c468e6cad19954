"""Batch-1 decode's kernel chain without attention, bf16 against FP8 weights: where the FP8 layer's time goes
beyond its GEMMs.

Qwen3-8B's layer minus attention, one row, bf16 and FP8 (block-128) weights: RMS norm -> qkv -> o (on the
first 4,096 of qkv's columns) -> RMS norm -> gate_up -> SiLU-mul -> down, over 8 layers of their own weights
(past L2), captured in one CUDA graph and replayed: us a layer and the weight bytes / time as a share of
the copy bandwidth measured in the same call; each also with SiLU-mul the other way than the default (in the
gate_up launch or apart: ``gemv.GATED_MAX_ROWS``, ``fp8_gemm.GATED_MAX_ROWS``), then the default again;
FP8 also with the MLP's RMS norm writing gate_up's e4m3 codes (``rms_norm_fp8``), then the default again.
``fp8_gemm_probe.py`` times the same GEMMs one by one.
``--trace``: a torch-profiler trace of three replays each, and per kernel its launches a layer, mean time
and mean idle gap before it (where the time between the GEMMs goes). ``--variants``: the FP8 chain again
with the skinny launch changed from ``fp8_configs.skinny_config``'s table (key splits, stages, warps, 64-row
programs) for all four GEMMs: a launch that loses alone can win between other kernels.

    python tests/gpu/decode_chain.py [--layers 8] [--trace] [--variants]

Writes $OUT/decode_chain.json (and the traces) (or ./gpu-results).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
from collections import defaultdict

import torch
from kernel_bench import bench_ms  # tests/gpu/, next to this script

from atom import ops
from atom.benchmarks.model_configs import copy_bandwidth
from atom.ops import reference_fp8
from atom.ops.triton import fp8_gemm, gemv
from atom.ops.triton.fp8_configs import skinny_config
from atom.ops.triton.fp8_gemm import fp8_linear
from atom.ops.triton.fp8_gemv import Fp8GemvConfig, fp8_gemv
from atom.ops.triton.norm import rms_norm_fp8

DEV = "cuda"
HIDDEN, QKV, INTER = 4096, 6144, 12288
NAMES, SHAPES = ("qkv", "o", "gate_up", "down"), [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def layer_weights(fp8: bool) -> tuple[list, int]:
    """One layer's four linears as callables (gate_up's with SiLU-mul, as the MLP calls it), and their weight
    bytes."""
    calls, nbytes = [], 0
    for name, (n, k) in zip(NAMES, SHAPES):
        w = torch.randn(n, k, device=DEV) / k**0.5
        if fp8:
            q, s = reference_fp8.quantize_weight(w, 128, 128)
            s = s.t().contiguous().t()  # K-major, as the FP8 layers keep them
            op = fp8_gemm.fp8_gated_linear if name == "gate_up" else fp8_linear
            calls.append(functools.partial(op, w=q, w_scale=s, group_k=128))
            nbytes += q.numel() + s.numel() * 4
        else:
            w16 = w.to(torch.bfloat16)
            calls.append(functools.partial(gemv.gated_linear if name == "gate_up" else gemv.linear, weight=w16))
            nbytes += w16.numel() * 2
    return calls, nbytes


def chain(x, layers, norm_w):
    for qkv, o, gate_up_act, down in layers:
        h = o(qkv(ops.rms_norm(x, norm_w, 1e-6))[:, :HIDDEN])
        x = down(gate_up_act(ops.rms_norm(h, norm_w, 1e-6)))
    return x


def chain_norm_codes(x, layers, norm_w):
    """The FP8 chain with the MLP's RMS norm writing gate_up's e4m3 codes and scales (``rms_norm_fp8``) and
    gate_up given them (as the models run with ``fp8.NORM_WRITES_CODES``), not quantising its input itself."""
    for qkv, o, gate_up_act, down in layers:
        h = o(qkv(ops.rms_norm(x, norm_w, 1e-6))[:, :HIDDEN])
        normed, _, codes, scales = rms_norm_fp8(h, norm_w, 1e-6, group_k=128)
        x = down(gate_up_act(normed, x_codes=codes, x_scales=scales))
    return x


def captured(layers, norm_w, x, fn=chain) -> torch.cuda.CUDAGraph:
    fn(x, layers, norm_w)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x, layers, norm_w)
    return graph


# the FP8 launch's variants at one row, each a set of (module, name, replacement) patches: the skinny
# kernel on every layer (fp8_configs.gemv_config giving none) or only where the GEMV does not run (the
# default: gate_up, down), its launch changed for a layer of n weight rows and k keys; or the CUDA-core
# GEMV on every layer with another launch
def _skinny(change, everywhere: bool = True) -> list:
    patches = [(fp8_gemm, "skinny_config", lambda n, k, g: change(skinny_config(n, k, g), n, k))]
    return (patches + [(fp8_gemm, "gemv_config", lambda n, k, g: None)]) if everywhere else patches


def _gemv(block_n: int, block_k: int, num_warps: int, half: bool = True) -> list:
    cfg = Fp8GemvConfig(block_n, block_k, num_warps, half=half)
    return [(fp8_gemm, "gemv_config", lambda n, k, g: cfg)]


def _grid(c, n: int) -> int:
    return -(-n // c.block_n) * c.split_k


def _where(test, **changes):
    """A skinny launch change for the layers ``test(n, k)`` picks."""
    return lambda c, n, k: dataclasses.replace(c, **changes) if test(n, k) else c


def _down(n: int, k: int) -> bool:
    return k > n


def _gate_up(n: int, k: int) -> bool:
    return n > 2 * k


# (rows a program, keys a step, warps, runs of 16 summed in f16); session 33's chain: the first four
# of the 13 swept were the fastest on every layer (89.8-99.6 us against 93.9-128.7)
GEMV_LAUNCHES = [(8, 2048, 4, True), (16, 2048, 8, True), (16, 1024, 4, True), (4, 2048, 2, True),
                 (8, 1024, 4, False)]  # fmt: skip


def _name(bn: int, bk: int, w: int, half: bool) -> str:
    return f"gemv {bn}x{bk} w{w}" + ("" if half else " f32")


VARIANTS = {
    "skinny everywhere (session 32's launch)": _skinny(lambda c, n, k: c),
    "skinny everywhere, 4 stages where the grid fits 2 programs an SM": _skinny(
        lambda c, n, k: dataclasses.replace(c, num_stages=4 if _grid(c, n) <= 2 * 132 else c.num_stages)
    ),
    "down 4 stages": _skinny(_where(_down, num_stages=4), everywhere=False),
    "down 16 splits (8 in the table)": _skinny(_where(_down, split_k=16), everywhere=False),
    "down 4 warps, 4 stages": _skinny(_where(_down, num_warps=4, num_stages=4), everywhere=False),
    "gate_up no split": _skinny(_where(_gate_up, split_k=1), everywhere=False),
    "gate_up 4 splits": _skinny(_where(_gate_up, split_k=4), everywhere=False),
    "gate_up 2 stages": _skinny(_where(_gate_up, num_stages=2), everywhere=False),
    **{_name(*launch): _gemv(*launch) for launch in GEMV_LAUNCHES},
}


@contextlib.contextmanager
def patched(patches: list):
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def variant_rows(built, norm_w, x, bw: float, layers: int) -> list[dict]:
    """The FP8 chain's us a layer under each variant of the one-row launch."""
    rows = []
    for name, patches in VARIANTS.items():
        with patched(patches):
            graph = captured([c for c, _ in built], norm_w, x)
            ms = bench_ms(graph.replay, 50) / layers
        rows.append(dict(weights=f"fp8 {name}", us=ms * 1e3, floor_pct=100 * built[0][1] / (ms * 1e-3) / bw))
        print(rows[-1], flush=True)
        del graph
    return rows


def launches(n: int, k: int, x: torch.Tensor) -> dict:
    """The one-row launches of an [n, k] FP8 GEMM, each a callable of (weight, scales); and the skinny kernel
    given the row's codes and scales (no quantisation in it: what the in-kernel quantisation costs)."""
    table = {"skinny": lambda q, s: gemv.skinny_gemm(x, q, None, skinny_config(n, k, 128), scales=(None, s, 128),
                                                     out_dtype=torch.bfloat16)}  # fmt: skip
    a, a_s = fp8_gemm.per_token_group_quant_fp8(x, 128)
    table["skinny, codes given"] = lambda q, s: gemv.skinny_gemm(
        a, q, None, skinny_config(n, k, 128), scales=(a_s, s, 128), out_dtype=torch.bfloat16
    )
    for bn, bk, w, half in GEMV_LAUNCHES:
        cfg = Fp8GemvConfig(bn, bk, w, half=half)
        table[_name(bn, bk, w, half)] = lambda q, s, cfg=cfg: fp8_gemv(x, q, s, 128, cfg)
    return table


def gemm_rows(bw: float, layers: int) -> list[dict]:
    """Each FP8 GEMM alone at one row over ``layers`` copies of its weight (past L2), one graph
    each: the skinny kernel and every GEMV launch, us a call and % of the copy bandwidth."""
    rows = []
    for name, (n, k) in zip(NAMES, SHAPES):
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        weights = [reference_fp8.quantize_weight(torch.randn(n, k, device=DEV) / k**0.5, 128, 128)
                   for _ in range(layers)]  # fmt: skip
        weights = [(q, s.t().contiguous().t()) for q, s in weights]
        for launch, fn in launches(n, k, x).items():
            for q, s in weights:
                fn(q, s)  # compiled outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for q, s in weights:
                    fn(q, s)
            us = bench_ms(graph.replay, 50) / layers * 1e3
            rows.append(dict(gemm=name, launch=launch, us=us, bw_pct=100 * n * k / (us * 1e-6) / bw))
            del graph
        print(f"{name}: " + ", ".join(f"{r['launch']} {r['us']:.1f}" for r in rows if r["gemm"] == name), flush=True)
        del weights
    return rows


def kernel_table(graph: torch.cuda.CUDAGraph, path: str, layers: int, replays: int = 3) -> list[dict]:
    """Per kernel name: launches a layer, mean us, mean idle gap before it (us), from a trace of ``replays``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e), key=lambda e: e["ts"])
    stats = defaultdict(lambda: [0, 0.0, 0.0])
    for prev, e in zip(kernels, kernels[1:]):  # the first kernel of the window has no gap before it
        row = stats[e["name"][:60]]
        row[0] += 1
        row[1] += e["dur"]
        row[2] += max(0.0, e["ts"] - prev["ts"] - prev["dur"])
    per_layer = replays * layers
    return [dict(kernel=k, per_layer=n / per_layer, us=t / n, gap_us=g / n) for k, (n, t, g) in stats.items()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--trace", action="store_true", help="also each kernel's time and the gap before it")
    parser.add_argument("--variants", action="store_true", help="also the FP8 chain under other one-row launches")
    parser.add_argument("--gemms", action="store_true", help="also each FP8 GEMM alone under each launch")
    args = parser.parse_args()
    out_dir = os.environ.get("OUT", "gpu-results")
    os.makedirs(out_dir, exist_ok=True)
    bw = copy_bandwidth()
    norm_w = torch.rand(HIDDEN, device=DEV, dtype=torch.bfloat16) + 0.5
    x = torch.randn(1, HIDDEN, device=DEV, dtype=torch.bfloat16)
    rows, kernels = [], {}
    for fp8 in (False, True):
        name = "fp8" if fp8 else "bf16"
        built = [layer_weights(fp8) for _ in range(args.layers)]
        graph = captured([c for c, _ in built], norm_w, x)
        ms = bench_ms(graph.replay, 50) / args.layers
        rows.append(dict(weights=name, us=ms * 1e3, floor_pct=100 * built[0][1] / (ms * 1e-3) / bw))
        print(rows[-1], flush=True)
        if args.trace:
            kernels[name] = kernel_table(graph, f"{out_dir}/decode_chain_{name}.json", args.layers)
        del graph
        # SiLU-mul in the skinny kernel's epilogue (gemv.gated_linear, fp8_gemm.fp8_gated_linear) or its own launch:
        # the other way than the default, then the default again (session 36, H100: the FP8 chain's second
        # capture read ~2.4 us a layer more whichever way it ran; compare rows of one position)
        module = fp8_gemm if fp8 else gemv
        on = module.GATED_MAX_ROWS >= 1
        flipped = f"SiLU-mul {'apart' if on else 'in the gate_up launch'}"
        for label, patches in ((flipped, [(module, "GATED_MAX_ROWS", 1 - on)]), ("again", [])):
            with patched(patches):
                graph = captured([c for c, _ in built], norm_w, x)
                ms = bench_ms(graph.replay, 50) / args.layers
            rows.append(dict(weights=f"{name}, {label}", us=ms * 1e3, floor_pct=100 * built[0][1] / (ms * 1e-3) / bw))
            print(rows[-1], flush=True)
            del graph
        if fp8:  # gate_up given its codes by the norm, then the default again
            for label, fn in (("gate_up codes from the RMS norm", chain_norm_codes), ("again", chain)):
                graph = captured([c for c, _ in built], norm_w, x, fn)
                ms = bench_ms(graph.replay, 50) / args.layers
                rows.append(dict(weights=f"{name}, {label}", us=ms * 1e3,
                                 floor_pct=100 * built[0][1] / (ms * 1e-3) / bw))  # fmt: skip
                print(rows[-1], flush=True)
                del graph
        if fp8 and args.variants:
            rows += variant_rows(built, norm_w, x, bw, args.layers)
        del built
        torch.cuda.empty_cache()
    gemms = gemm_rows(bw, args.layers) if args.gemms else []
    json.dump(dict(device=torch.cuda.get_device_name(), copy_tbps=bw / 1e12, rows=rows, kernels=kernels, gemms=gemms),
              open(f"{out_dir}/decode_chain.json", "w"), indent=1)  # fmt: skip
    for name, table in kernels.items():
        print(f"\n{name}: kernel | launches a layer | us | idle gap before it, us")
        for k in sorted(table, key=lambda k: -k["per_layer"] * (k["us"] + k["gap_us"])):
            print(f"  {k['kernel']:<60} {k['per_layer']:4.1f} {k['us']:7.2f} {k['gap_us']:6.2f}")
    print(f"\n{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s; Qwen3-8B layer minus attention, 1 row\n")
    if gemms:
        names = list(dict.fromkeys(r["launch"] for r in gemms))
        print("| launch | " + " | ".join(NAMES) + " |  (us, % of the copy bandwidth)")
        print("|---|---|---|---|---|")
        for launch in names:
            cells = [f"{r['us']:.1f} ({r['bw_pct']:.0f}%)" for r in gemms if r["launch"] == launch]
            print(f"| {launch} | " + " | ".join(cells) + " |")
        print()
    print("| weights | us / layer | % of the copy floor |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['weights']} | {r['us']:.1f} | {r['floor_pct']:.0f}% |")


if __name__ == "__main__":
    main()
