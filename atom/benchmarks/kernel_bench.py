"""Microbenchmarks of atom's Triton kernels against the machine's measured ceilings.

    python -m atom.benchmarks.kernel_bench [--output-json kernels.json] [--sweep]

Memory-bound cases (decode attention, rms_norm, small-batch MoE, sampling) report GB/s of
the bytes they must move at least once; compute-bound cases (prefill attention,
large-batch MoE) report TFLOP/s. Each is shown next to the ceilings measured here:
device-to-device copy bandwidth (a 2 GiB copy, bytes read + written) and the bf16 GEMM
rate of torch.matmul (8192^3).

Kernel times are device times: the calls are replayed from a CUDA graph (as the engine
does for decode; host launch overhead would otherwise dominate the small cases), over
enough independent copies of the inputs that they do not stay in L2 between calls.
``--sweep`` also times alternative tile configs of attention and MoE and split-K factors
of decode attention, which is how the defaults in ``atom.ops.triton`` were picked.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable

import torch
import triton

from atom.ops import reference
from atom.ops import triton as tk
from atom.ops.triton import attention, moe

BF16 = torch.bfloat16
DEV = "cuda"


def bench_ms(fn: Callable[[], object], rep: int = 100) -> float:
    """Median time of ``fn`` in ms (CUDA events, after warm-up)."""
    return triton.testing.do_bench(fn, warmup=rep // 4, rep=rep, return_mode="median")


def copy_gbps() -> float:
    src = torch.randn(1 << 30, dtype=BF16, device=DEV)  # 2 GiB, far larger than L2
    dst = torch.empty_like(src)
    return 2 * src.nbytes / bench_ms(lambda: dst.copy_(src)) / 1e6


def gemm_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=BF16, device=DEV)
    b = torch.randn(n, n, dtype=BF16, device=DEV)
    return 2 * n**3 / bench_ms(lambda: a @ b) / 1e9


# --- cases: each builder returns (fn, bytes that must move, flops) ----------------------


def attention_case(q_lens, context_lens, num_decode_tokens=0, num_q_heads=32, num_kv_heads=8, head_dim=128):
    """Qwen3-8B attention heads by default, block size 16, each sequence's blocks scattered."""
    block_size = 16
    seq_lens = [c + q for c, q in zip(context_lens, q_lens)]
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * max_blocks
    tables = torch.randperm(num_blocks, dtype=torch.int32, device=DEV).view(len(seq_lens), max_blocks)
    k_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, dtype=BF16, device=DEV)
    v_cache = torch.randn_like(k_cache)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEV)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, dtype=BF16, device=DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    max_q, max_k = max(q_lens), max(seq_lens)

    def fn():
        return tk.paged_attention(
            q, k_cache, v_cache, cu, lens, tables, head_dim**-0.5, max_q, max_k, num_decode_tokens=num_decode_tokens
        )

    kv_bytes = sum(seq_lens) * num_kv_heads * head_dim * 2 * 2
    qo_bytes = 2 * q.nbytes
    # Causal: query j of a sequence sees context + j + 1 keys; QK^T and PV are 2 flops each.
    visible = sum(q * c + q * (q + 1) // 2 for q, c in zip(q_lens, context_lens))
    return fn, kv_bytes + qo_bytes, 4 * num_q_heads * head_dim * visible


def moe_case(num_tokens, hidden=2048, inter=768, num_experts=128, top_k=8):
    """Qwen3-30B-A3B experts by default, routed by random router logits."""
    x = torch.randn(num_tokens, hidden, dtype=BF16, device=DEV)
    w13 = torch.randn(num_experts, 2 * inter, hidden, dtype=BF16, device=DEV) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, dtype=BF16, device=DEV) * inter**-0.5
    weights, ids = tk.moe_topk(torch.randn(num_tokens, num_experts, device=DEV), top_k, True)

    def fn():
        return tk.fused_moe(x, w13, w2, weights, ids)

    used = ids.unique().numel()
    weight_bytes = used * 3 * hidden * inter * 2
    return fn, weight_bytes + 2 * x.nbytes, 2 * num_tokens * top_k * 3 * hidden * inter


def rms_norm_case(num_tokens, hidden=4096):
    x = torch.randn(num_tokens, hidden, dtype=BF16, device=DEV)
    residual = torch.randn_like(x)
    w = torch.randn(hidden, dtype=BF16, device=DEV)
    # Reads x and residual, writes the output and the new residual.
    return (lambda: tk.rms_norm(x, w, 1e-6, residual)), 4 * x.nbytes, 0


def sampling_case(rows, impl, vocab=151936):
    """Qwen3 vocabulary, float32 logits, top_k=50 top_p=0.9 (Qwen3's recommended settings
    are top_k=20 top_p=0.95); ``impl`` is the kernel or the sort-based reference."""
    logits = torch.randn(rows, vocab, device=DEV) * 3
    top_k = torch.full((rows,), 50, device=DEV)
    top_p = torch.full((rows,), 0.9, device=DEV)
    return (lambda: impl(logits, top_k, top_p, None)), 2 * logits.nbytes, 0


def cases() -> list[tuple[str, str, Callable]]:
    """(kernel, shape, case builder)."""
    out = []
    for batch, ctx in [(1, 1024), (1, 8192), (32, 1024), (32, 8192), (256, 1024), (256, 4096), (512, 1024)]:
        out.append(("attn decode", f"b={batch} ctx={ctx}", lambda b=batch, c=ctx: attention_case([1] * b, [c] * b)))
    for q_len, ctx in [(2048, 0), (8192, 0), (2048, 6144)]:
        out.append(("attn prefill", f"q={q_len} ctx={ctx}", lambda q=q_len, c=ctx: attention_case([q], [c])))
    # Chunked prefill next to 64 decode rows, which come first in the batch.
    mixed = [1] * 64 + [512], [2048] * 64 + [4096]
    out.append(("attn mixed", "64 dec ctx=2k + q=512 ctx=4k", lambda: attention_case(*mixed)))
    out.append(("attn mixed", "  same, num_decode_tokens=64", lambda: attention_case(*mixed, num_decode_tokens=64)))
    for n in [1, 16, 128, 512, 2048, 8192]:
        out.append(("fused_moe", f"T={n} E=128 top8", lambda n=n: moe_case(n)))
    for n in [1, 512, 8192]:
        out.append(("rms_norm+res", f"T={n} H=4096", lambda n=n: rms_norm_case(n)))
    for rows in [1, 256]:
        out.append(("top_k_top_p", f"B={rows} V=151936", lambda r=rows: sampling_case(r, tk.top_k_top_p_min_p)))
        out.append(("  torch sort", f"B={rows} V=151936", lambda r=rows: sampling_case(r, reference.top_k_top_p_min_p)))
    return out


def prepare(builder: Callable) -> tuple[list[Callable], int, int]:
    """The case's calls over enough input copies (4x L2) to defeat the cache, its bytes, flops."""
    fn, nbytes, flops = builder()
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    copies = min(64, max(1, -(-4 * l2 // max(nbytes, 1))))
    return [fn] + [builder()[0] for _ in range(copies - 1)], nbytes, flops


def graph_ms(fns: list[Callable], rep: int = 100) -> float:
    """Device time per call: all ``fns`` captured in one CUDA graph, replays timed."""
    for fn in fns:  # compile and allocate outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return bench_ms(graph.replay, rep) / len(fns)


def row(ms: float, nbytes: int, flops: int) -> dict:
    return dict(ms=ms, gbps=nbytes / ms / 1e6, tflops=flops / ms / 1e9)


# --- config sweep -----------------------------------------------------------------------


def sweep() -> list[dict]:
    rows = []
    default_attn, default_moe = attention._config, moe._gemm_config
    decode_cfgs = [
        dict(block_m=16, block_n=n, num_warps=w, num_stages=s)
        for n, w, s in [(32, 4, 2), (64, 2, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2), (128, 4, 3)]
    ]
    prefill_cfgs = [
        dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
        for m, n, w, s in [(64, 64, 4, 2), (64, 128, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2)]
    ]
    moe_cfgs = [
        dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
        for m, n, k, w, s in [
            (16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (16, 64, 256, 4, 3),
            (32, 64, 128, 4, 4), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3),
        ]
    ]  # fmt: skip
    targets = [
        ("decode b=256 ctx=1k", lambda: attention_case([1] * 256, [1024] * 256), attention, "_config", decode_cfgs),
        ("decode b=32 ctx=1k", lambda: attention_case([1] * 32, [1024] * 32), attention, "_config", decode_cfgs),
        ("decode b=1 ctx=8k", lambda: attention_case([1], [8192]), attention, "_config", decode_cfgs),
        ("prefill q=8k", lambda: attention_case([8192], [0]), attention, "_config", prefill_cfgs),
        ("splits b=1 ctx=8k", lambda: attention_case([1], [8192]), attention, "_num_splits", [1, 4, 8, 16, 32, 64]),
        ("splits b=32 ctx=1k", lambda: attention_case([1] * 32, [1024] * 32), attention, "_num_splits", [1, 2, 4, 8]),
        ("splits b=32 ctx=8k", lambda: attention_case([1] * 32, [8192] * 32), attention, "_num_splits", [1, 2, 4, 8]),
        *[(f"moe T={n}", lambda n=n: moe_case(n), moe, "_gemm_config", moe_cfgs) for n in [1, 16, 512, 4096]],
    ]
    try:
        for name, builder, module, attr, cfgs in targets:
            fns, nbytes, flops = prepare(builder)
            default = getattr(module, attr)
            for cfg in [None, *cfgs]:  # None: the default
                setattr(module, attr, default if cfg is None else (lambda *_, c=cfg: c))
                try:
                    ms = graph_ms(fns, rep=30)
                except Exception as e:  # e.g. out of shared memory for a large tile
                    print(f"  {name} {cfg}: {type(e).__name__}")
                    continue
                rows.append(dict(case=name, config="default" if cfg is None else cfg, **row(ms, nbytes, flops)))
            setattr(module, attr, default)
            del fns
            torch.cuda.empty_cache()
    finally:
        attention._config, moe._gemm_config = default_attn, default_moe
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-json", help="write all results here")
    parser.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    args = parser.parse_args()

    bw, tf = copy_gbps(), gemm_tflops()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s, bf16 matmul {tf:.0f} TFLOP/s")
    results = []
    print(f"{'kernel':<14} {'shape':<30} {'ms':>9} {'GB/s':>8} {'%copy':>6} {'TFLOP/s':>8} {'%gemm':>6}")
    for kernel, shape, builder in cases():
        fns, nbytes, flops = prepare(builder)
        r = row(graph_ms(fns), nbytes, flops)
        results.append(dict(kernel=kernel, shape=shape, **r))
        tflops = f"{r['tflops']:8.1f} {100 * r['tflops'] / tf:5.0f}%" if r["tflops"] else ""
        print(f"{kernel:<14} {shape:<30} {r['ms']:9.4f} {r['gbps']:8.0f} {100 * r['gbps'] / bw:5.0f}% {tflops}")
        del fns
        torch.cuda.empty_cache()

    sweep_rows = []
    if args.sweep:
        sweep_rows = sweep()
        print("\nsweep (best 3 per case, and the default):")
        for case in dict.fromkeys(r["case"] for r in sweep_rows):
            rows = sorted((r for r in sweep_rows if r["case"] == case), key=lambda r: r["ms"])
            shown = rows[:3] + [r for r in rows[3:] if r["config"] == "default"]
            for r in shown:
                print(f"  {case:<20} {r['ms']:8.4f} ms {r['gbps']:6.0f} GB/s {r['tflops']:6.1f} TF  {r['config']}")

    if args.output_json:
        machine = dict(device=torch.cuda.get_device_name(), copy_gbps=bw, bf16_matmul_tflops=tf)
        with open(args.output_json, "w") as f:
            json.dump(dict(machine=machine, results=results, sweep=sweep_rows), f, indent=2)


if __name__ == "__main__":
    main()
