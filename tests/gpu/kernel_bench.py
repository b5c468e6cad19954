"""Microbenchmarks of atom's Triton kernels against the machine's measured ceilings.

    python tests/gpu/kernel_bench.py [--output-json kernels.json] [--only attn]

Memory-bound cases (decode attention, rms_norm, small-batch MoE, sampling) report GB/s of the bytes they
must move at least once, compute-bound ones (prefill attention, large-batch MoE) TFLOP/s, next to the
ceilings measured here: device copy bandwidth and the bf16 rate of torch.matmul (8192^3). Times are
device times: the calls are replayed from a CUDA graph over enough copies of the inputs that they do
not stay in L2. ``+packed K/V`` rows also pass the chunk's own K/V packed (``paged_attention(k=, v=)``).
tests/gpu/kernel_sweep.py times alternative tile configs the same way (how the defaults in
``atom.ops.triton`` were picked).

Where vLLM is importable, each attention case also runs its FlashAttention 3 (``flash_attn_varlen_func``,
paged, as its FLASH_ATTN backend calls it) and each MoE case its ``fused_experts``, on the same data:
``ratio`` = reference time / atom time (> 1: atom is faster), ``diff`` = max abs difference of the outputs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import logging
from collections.abc import Callable

import torch
import triton

from atom.benchmarks.benchmark_utils import add_arguments, write_to_json
from atom.benchmarks.model_configs import copy_bandwidth
from atom.ops import triton as tk

BF16 = torch.bfloat16
DEV = "cuda"


@functools.cache
def vllm_kernels() -> tuple[Callable | None, Callable | None]:
    """vLLM's FlashAttention 3 varlen entry point and fused_experts, or None where missing."""
    fa3 = fused_experts = None
    with contextlib.suppress(ImportError):
        from vllm.vllm_flash_attn import flash_attn_varlen_func as fa3
    with contextlib.suppress(ImportError):
        from vllm.model_executor.layers.fused_moe import fused_experts
    return fa3, fused_experts


def bench_ms(fn: Callable[[], object], rep: int = 100) -> float:
    """Median time of ``fn`` in ms (CUDA events, after warm-up)."""
    return triton.testing.do_bench(fn, warmup=rep // 4, rep=rep, return_mode="median")


def gemm_tflops(n: int = 8192) -> float:
    a, b = (torch.randn(n, n, dtype=BF16, device=DEV) for _ in range(2))
    return 2 * n**3 / bench_ms(lambda: a @ b) / 1e9


# --- cases: each builder returns (atom's call, the reference's call or None, bytes that must move, flops)


def attention_inputs(q_lens, context_lens, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16):
    """Qwen3-8B attention heads by default, each sequence's blocks scattered:
    q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables."""
    seq_lens = [c + q for c, q in zip(context_lens, q_lens)]
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * max_blocks
    tables = torch.randperm(num_blocks, dtype=torch.int32, device=DEV).view(len(seq_lens), max_blocks)
    k_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, dtype=BF16, device=DEV)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEV)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, dtype=BF16, device=DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    return q, k_cache, torch.randn_like(k_cache), cu, lens, tables


def new_kv(k_cache, v_cache, tables, q_lens, context_lens) -> dict:
    """The new tokens' K/V, packed [tokens, kv_heads, head_dim], read back from the cache."""
    pos = torch.cat([torch.arange(c, c + n, device=DEV) for c, n in zip(context_lens, q_lens)])
    seq = torch.repeat_interleave(torch.arange(len(q_lens), device=DEV), torch.tensor(q_lens, device=DEV))
    slots, offs = tables[seq, pos // k_cache.shape[2]].long(), pos % k_cache.shape[2]
    return dict(k=k_cache[slots, :, offs], v=v_cache[slots, :, offs])


def attention_cost(q, k_cache, q_lens, context_lens) -> tuple[int, int]:
    """Bytes that must move (K/V once, Q and the output) and flops of causal attention."""
    num_q_heads, num_kv_heads, head_dim = q.shape[1], k_cache.shape[1], q.shape[2]
    kv_bytes = (sum(q_lens) + sum(context_lens)) * num_kv_heads * head_dim * 2 * 2
    # Causal: query j of a sequence sees context + j + 1 keys; QK^T and PV are 2 flops each.
    visible = sum(n * c + n * (n + 1) // 2 for n, c in zip(q_lens, context_lens))
    return kv_bytes + 2 * q.nbytes, 4 * num_q_heads * head_dim * visible


def attention_case(q_lens, context_lens, packed=False, num_decode_tokens=0):
    """``packed``: also pass the new tokens' K/V packed (prefill reads them through descriptors)."""
    q, k_cache, v_cache, cu, lens, tables = attention_inputs(q_lens, context_lens)
    scale, max_q, max_k = q.shape[2] ** -0.5, max(q_lens), max(c + n for c, n in zip(context_lens, q_lens))
    kv = new_kv(k_cache, v_cache, tables, q_lens, context_lens) if packed else {}
    args = (q, k_cache, v_cache, cu, lens, tables, scale, max_q, max_k)
    ref, fa3 = None, vllm_kernels()[0]
    if fa3 is not None:  # vLLM's cache layout [blocks, block_size, kv_heads, head_dim], same values
        k_fa, v_fa = (c.permute(0, 2, 1, 3).contiguous() for c in (k_cache, v_cache))
        fa_args = dict(max_seqlen_q=max_q, cu_seqlens_q=cu, max_seqlen_k=max_k, seqused_k=lens, softmax_scale=scale)
        fa_args.update(causal=True, block_table=tables, out=torch.empty_like(q), fa_version=3)
        ref = functools.partial(fa3, q, k_fa, v_fa, **fa_args)
    fn = functools.partial(tk.paged_attention, *args, num_decode_tokens=num_decode_tokens, **kv)
    return fn, ref, *attention_cost(q, k_cache, q_lens, context_lens)


def moe_case(num_tokens, hidden=2048, inter=768, num_experts=128, top_k=8):
    """Qwen3-30B-A3B experts by default, routed by random router logits."""
    x = torch.randn(num_tokens, hidden, dtype=BF16, device=DEV)
    w13 = torch.randn(num_experts, 2 * inter, hidden, dtype=BF16, device=DEV) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, dtype=BF16, device=DEV) * inter**-0.5
    weights, ids = tk.moe_topk(torch.randn(num_tokens, num_experts, device=DEV), top_k, True)
    fused_experts = vllm_kernels()[1]
    ref = fused_experts and functools.partial(fused_experts, x, w13, w2, weights, ids.to(torch.int32))
    weight_bytes = ids.unique().numel() * 3 * hidden * inter * 2  # only the experts some token uses
    flops = 2 * num_tokens * top_k * 3 * hidden * inter
    return functools.partial(tk.fused_moe, x, w13, w2, weights, ids), ref, weight_bytes + 2 * x.nbytes, flops


def rms_norm_case(num_tokens, hidden=4096):
    x, residual = torch.randn(2, num_tokens, hidden, dtype=BF16, device=DEV)
    w = torch.randn(hidden, dtype=BF16, device=DEV)
    # Reads x and residual, writes the output and the new residual.
    return functools.partial(tk.rms_norm, x, w, 1e-6, residual), None, 4 * x.nbytes, 0


SAMPLE_TOP_K = 50


def sort_sample(logits, temps, top_k, top_p):
    """Sort-based sampling (vLLM's PyTorch path): sort, top-k/top-p masks, scatter back, softmax,
    exponential race."""
    x, idx = (logits / temps[:, None]).sort(dim=-1)
    x.masked_fill_(x < x.gather(1, (x.shape[1] - top_k.long())[:, None]), float("-inf"))
    drop = x.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p[:, None]
    drop[:, -1] = False
    x.masked_fill_(drop, float("-inf"))
    probs = x.scatter(1, idx, x).softmax(dim=-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def topk_sample(logits, temps, top_k, top_p, max_k=SAMPLE_TOP_K):
    """torch.topk-based: top-p and the draw over the ``max_k`` (>= every top_k) largest logits only."""
    x, idx = (logits / temps[:, None]).topk(max_k, dim=-1)
    x.masked_fill_(torch.arange(x.shape[1], device=DEV) >= top_k[:, None], float("-inf"))
    probs = x.softmax(dim=-1)
    probs.masked_fill_(probs.cumsum(dim=-1) - probs >= top_p[:, None], 0.0)
    return idx.gather(1, (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1, keepdim=True))[:, 0]


def plain_sample(logits, temps, top_k, top_p):
    """Temperature only (vLLM's path without top-k / top-p): softmax, exponential race."""
    probs = (logits / temps[:, None]).softmax(dim=-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def sampling_case(rows, ref, vocab=151936, plain=False):
    """float32 logits, temperature 0.8, top_k=50 top_p=0.9 (Qwen3 recommends 20 / 0.95), or
    temperature only (``plain``): atom's kernel against ``ref``; the floor is reading the logits once."""
    logits, temps = torch.randn(rows, vocab, device=DEV) * 3, torch.full((rows,), 0.8, device=DEV)
    top_k, top_p = torch.full((rows,), SAMPLE_TOP_K, device=DEV), torch.full((rows,), 0.9, device=DEV)
    seeds = torch.randint(1 << 62, (rows,), device=DEV)
    if plain:
        top_k = top_p = None
    fn = functools.partial(tk.sample_tokens, logits, temps, top_k, top_p, None, seeds)
    return fn, functools.partial(ref, logits, temps, top_k, top_p), logits.nbytes, 0


# prefill (q_lens, context) shapes; chunked prefill next to 64 decode rows, which come first in the batch
PREFILL = [([512], 0), ([2048], 0), ([8192], 0), ([2048] * 8, 0), ([512], 4096), ([2048], 4096), ([2048], 6144)]
PREFILL += [([512] * 4, 4096)]
MIXED = [1] * 64 + [512], [2048] * 64 + [4096]


def cases() -> list[tuple[str, str, Callable]]:
    """(kernel, shape, case builder): the sweep of issue 13 at Qwen3-8B / Qwen3-30B-A3B shapes."""
    out, case = [], functools.partial
    for b, c in itertools.product([1, 8, 32, 64, 256], [512, 2048, 8192, 32768]):
        if b * c <= 2 * 1024 * 1024:  # KV of larger points would not fit twice (two layouts)
            out.append(("attn decode", f"b={b} ctx={c}", case(attention_case, [1] * b, [c] * b)))
    for q, c in PREFILL:
        shape = f"q={q[0]}{f'x{len(q)}' if len(q) > 1 else ''} ctx={c}"
        out += [
            ("attn prefill", label, case(attention_case, q, [c] * len(q), p))
            for label, p in [(shape, False), ("  +packed K/V", True)]
        ]
    out.append(("attn mixed", "64 dec ctx=2k + q=512 ctx=4k", case(attention_case, *MIXED, num_decode_tokens=64)))
    out.append(("attn mixed", "  +packed K/V", case(attention_case, *MIXED, packed=True, num_decode_tokens=64)))
    out += [("fused_moe", f"T={n} E=128 top8", case(moe_case, n)) for n in [1, 16, 128, 512, 2048, 4096, 8192]]
    out += [("rms_norm+res", f"T={n} H=4096", case(rms_norm_case, n)) for n in [1, 512, 8192]]
    for rows, vocab in [(1, 151936), (8, 151936), (64, 151936), (256, 151936), (256, 128256), (256, 49152)]:
        out.append(("sample", f"B={rows} V={vocab} vs sort", case(sampling_case, rows, sort_sample, vocab)))
        out.append(("sample", "  vs torch.topk", case(sampling_case, rows, topk_sample, vocab)))
    for rows in [1, 4, 8, 64, 256]:
        out.append(("sample", f"B={rows} temperature only", case(sampling_case, rows, plain_sample, plain=True)))
    return out


def prepare(builder: Callable) -> tuple[list[Callable], list[Callable] | None, int, int]:
    """The case's atom and reference calls over enough input copies (4x L2) to defeat the cache, its
    bytes and flops."""
    fn, ref, nbytes, flops = builder()
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    more = [builder()[:2] for _ in range(min(64, max(1, -(-4 * l2 // max(nbytes, 1)))) - 1)]
    return [fn] + [f for f, _ in more], None if ref is None else [ref] + [r for _, r in more], nbytes, flops


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


def compare(fns: list[Callable], refs: list[Callable] | None) -> dict:
    """Reference time and max abs difference of the outputs."""
    if refs is None:
        return {}
    out, ref = fns[0](), refs[0]()  # sampled tokens (different noise): no diff
    diff = (out.float() - ref.float()).abs().max().item() if out.is_floating_point() else float("nan")
    return dict(ref_ms=graph_ms(refs), diff=diff)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    only = ("--only", "", "run only the cases whose kernel name contains this")
    add_arguments(parser, [("--output-json", str, "write all results here"), only])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    fa3, fused_experts = vllm_kernels()
    bw, tf = copy_bandwidth() / 1e9, gemm_tflops()
    refs = f"FA3 {'yes' if fa3 else 'no'}, fused_experts {'yes' if fused_experts else 'no'}"
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s, bf16 matmul {tf:.0f} TFLOP/s; references: {refs}")
    results = []
    for kernel, shape, builder in (c for c in cases() if args.only in c[0]):
        fns, refs, nbytes, flops = prepare(builder)
        results.append(dict(kernel=kernel, shape=shape, **row(graph_ms(fns), nbytes, flops), **compare(fns, refs)))
        logging.info("%s %s: %s", kernel, shape, results[-1])
        del fns, refs
        torch.cuda.empty_cache()

    head = ("kernel", "shape", "ms", "GB/s", "%copy", "TF/s", "%gemm", "ref ms", "ratio", "diff")
    print("\n{:<13} {:<29} {:>8} {:>6} {:>5} {:>6} {:>5} {:>8} {:>6} {:>7}".format(*head))
    for r in results:
        tflops = f"{r['tflops']:6.1f} {100 * r['tflops'] / tf:4.0f}%" if r["tflops"] else " " * 12
        ref = f"{r['ref_ms']:8.4f} {r['ref_ms'] / r['ms']:6.2f} {r['diff']:7.4f}" if "ref_ms" in r else ""
        gbps = f"{r['gbps']:6.0f} {100 * r['gbps'] / bw:4.0f}%"
        print(f"{r['kernel']:<13} {r['shape']:<29} {r['ms']:8.4f} {gbps} {tflops} {ref}")
    if args.output_json:
        machine = dict(device=torch.cuda.get_device_name(), copy_gbps=bw, bf16_matmul_tflops=tf)
        write_to_json(args.output_json, dict(machine=machine, results=results), indent=2)


if __name__ == "__main__":
    main()
