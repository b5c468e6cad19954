"""Microbenchmarks of atom's Triton kernels against the machine's measured ceilings.

    python -m atom.benchmarks.kernel_bench [--output-json kernels.json] [--only attn] [--sweep moe prefill]

Memory-bound cases (decode attention, rms_norm, small-batch MoE, sampling) report GB/s of
the bytes they must move at least once; compute-bound cases (prefill attention,
large-batch MoE) report TFLOP/s. Each is shown next to the ceilings measured here:
device-to-device copy bandwidth (a 2 GiB copy, bytes read + written) and the bf16 GEMM
rate of torch.matmul (8192^3).

Kernel times are device times: the calls are replayed from a CUDA graph (as the engine
does for decode; host launch overhead would otherwise dominate the small cases), over
enough independent copies of the inputs that they do not stay in L2 between calls.
``--sweep moe prefill`` also times alternative tile configs of those kernels, which is how
the defaults in ``atom.ops.triton`` were picked. Prefill rows marked ``+packed K/V`` also
pass the chunk's own K/V packed (``atom.ops.triton.paged_attention(k=, v=)``).

Where vLLM is importable, each attention case also runs FlashAttention 3 as vLLM's
FLASH_ATTN backend calls it (``vllm.vllm_flash_attn.flash_attn_varlen_func``, paged, its
cache layout built from the same data) and each MoE case vLLM's ``fused_experts``, in the
same process on the same tensors: ``ratio`` = reference time / atom time (> 1: atom is
faster) and ``diff`` = max abs difference of the two outputs.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import logging
from collections.abc import Callable

import torch
import triton

from atom.ops import reference
from atom.ops import triton as tk
from atom.ops.triton import moe, prefill_attention

BF16 = torch.bfloat16
DEV = "cuda"


@functools.cache
def vllm_kernels() -> tuple[Callable | None, Callable | None]:
    """vLLM's FlashAttention 3 varlen entry point and fused_experts, or None where missing."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except ImportError:
        fused_experts = None
    return flash_attn_varlen_func, fused_experts


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


def attention_inputs(q_lens, context_lens, num_q_heads=32, num_kv_heads=8, head_dim=128):
    """Qwen3-8B attention heads by default, block size 16, each sequence's blocks scattered:
    q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables."""
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
    return q, k_cache, v_cache, cu, lens, tables


def new_kv(k_cache, v_cache, tables, q_lens, context_lens) -> dict:
    """The new tokens' K/V, packed [tokens, kv_heads, head_dim], read back from the cache."""
    pos = torch.cat([torch.arange(c, c + n, device=DEV) for c, n in zip(context_lens, q_lens)])
    seq = torch.repeat_interleave(torch.arange(len(q_lens), device=DEV), torch.tensor(q_lens, device=DEV))
    slots, offs = tables[seq, pos // k_cache.shape[2]].long(), pos % k_cache.shape[2]
    return dict(k=k_cache[slots, :, offs], v=v_cache[slots, :, offs])


def attention_case(q_lens, context_lens, packed=False, num_decode_tokens=0):
    """``packed``: also pass the new tokens' K/V packed (prefill reads them through descriptors)."""
    q, k_cache, v_cache, cu, lens, tables = attention_inputs(q_lens, context_lens)
    head_dim = q.shape[2]
    max_q, max_k = max(q_lens), max(c + n for c, n in zip(context_lens, q_lens))
    kv = new_kv(k_cache, v_cache, tables, q_lens, context_lens) if packed else {}

    def fn():
        return tk.paged_attention(q, k_cache, v_cache, cu, lens, tables, head_dim**-0.5, max_q, max_k,
                                  num_decode_tokens=num_decode_tokens, **kv)  # fmt: skip

    ref, fa3 = None, vllm_kernels()[0]
    if fa3 is not None:  # vLLM's cache layout [blocks, block_size, kv_heads, head_dim], same values
        k_fa, v_fa = (c.permute(0, 2, 1, 3).contiguous() for c in (k_cache, v_cache))
        out = torch.empty_like(q)

        def ref():
            return fa3(q, k_fa, v_fa, max_seqlen_q=max_q, cu_seqlens_q=cu, max_seqlen_k=max_k, seqused_k=lens,
                       softmax_scale=head_dim**-0.5, causal=True, block_table=tables, out=out,
                       fa_version=3)  # fmt: skip

    return fn, ref, *attention_cost(q, k_cache, q_lens, context_lens)


def attention_cost(q, k_cache, q_lens, context_lens) -> tuple[int, int]:
    """Bytes that must move (K/V once, Q and the output) and flops of causal attention."""
    num_q_heads, num_kv_heads, head_dim = q.shape[1], k_cache.shape[1], q.shape[2]
    kv_bytes = (sum(q_lens) + sum(context_lens)) * num_kv_heads * head_dim * 2 * 2
    # Causal: query j of a sequence sees context + j + 1 keys; QK^T and PV are 2 flops each.
    visible = sum(n * c + n * (n + 1) // 2 for n, c in zip(q_lens, context_lens))
    return kv_bytes + 2 * q.nbytes, 4 * num_q_heads * head_dim * visible


def moe_case(num_tokens, hidden=2048, inter=768, num_experts=128, top_k=8):
    """Qwen3-30B-A3B experts by default, routed by random router logits."""
    x = torch.randn(num_tokens, hidden, dtype=BF16, device=DEV)
    w13 = torch.randn(num_experts, 2 * inter, hidden, dtype=BF16, device=DEV) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, dtype=BF16, device=DEV) * inter**-0.5
    weights, ids = tk.moe_topk(torch.randn(num_tokens, num_experts, device=DEV), top_k, True)

    def fn():
        return tk.fused_moe(x, w13, w2, weights, ids)

    ids32 = ids.to(torch.int32)
    fused_experts = vllm_kernels()[1]
    ref = None if fused_experts is None else (lambda: fused_experts(x, w13, w2, weights, ids32))
    used = ids.unique().numel()
    weight_bytes = used * 3 * hidden * inter * 2
    return fn, ref, weight_bytes + 2 * x.nbytes, 2 * num_tokens * top_k * 3 * hidden * inter


def rms_norm_case(num_tokens, hidden=4096):
    x = torch.randn(num_tokens, hidden, dtype=BF16, device=DEV)
    residual = torch.randn_like(x)
    w = torch.randn(hidden, dtype=BF16, device=DEV)
    # Reads x and residual, writes the output and the new residual.
    return (lambda: tk.rms_norm(x, w, 1e-6, residual)), None, 4 * x.nbytes, 0


def sampling_case(rows, impl, vocab=151936):
    """Qwen3 vocabulary, float32 logits, top_k=50 top_p=0.9 (Qwen3's recommended settings
    are top_k=20 top_p=0.95); ``impl`` is the kernel or the sort-based reference."""
    logits = torch.randn(rows, vocab, device=DEV) * 3
    top_k = torch.full((rows,), 50, device=DEV)
    top_p = torch.full((rows,), 0.9, device=DEV)
    return (lambda: impl(logits, top_k, top_p, None)), None, 2 * logits.nbytes, 0


def cases() -> list[tuple[str, str, Callable]]:
    """(kernel, shape, case builder): the sweep of issue 13 at Qwen3-8B / Qwen3-30B-A3B shapes."""
    out = []
    for batch, ctx in itertools.product([1, 8, 32, 64, 256], [512, 2048, 8192, 32768]):
        if batch * ctx <= 2 * 1024 * 1024:  # KV of larger points would not fit twice (two layouts)
            out.append(("attn decode", f"b={batch} ctx={ctx}", lambda b=batch, c=ctx: attention_case([1] * b, [c] * b)))
    for q_lens, ctx in [([512], 0), ([2048], 0), ([8192], 0), ([2048] * 8, 0), ([512], 4096),
                        ([2048], 4096), ([2048], 6144), ([512] * 4, 4096)]:  # fmt: skip
        shape = f"q={q_lens[0]}{f'x{len(q_lens)}' if len(q_lens) > 1 else ''} ctx={ctx}"
        for packed in (False, True):
            label = "  +packed K/V" if packed else shape
            out.append(("attn prefill", label, lambda q=q_lens, c=ctx, p=packed: attention_case(q, [c] * len(q), p)))
    # Chunked prefill next to 64 decode rows, which come first in the batch (as the engine orders them).
    mixed = [1] * 64 + [512], [2048] * 64 + [4096]
    out.append(("attn mixed", "64 dec ctx=2k + q=512 ctx=4k", lambda: attention_case(*mixed, num_decode_tokens=64)))
    out.append(("attn mixed", "  +packed K/V", lambda: attention_case(*mixed, num_decode_tokens=64, packed=True)))
    for n in [1, 16, 128, 512, 2048, 4096, 8192]:
        out.append(("fused_moe", f"T={n} E=128 top8", lambda n=n: moe_case(n)))
    for n in [1, 512, 8192]:
        out.append(("rms_norm+res", f"T={n} H=4096", lambda n=n: rms_norm_case(n)))
    for rows in [1, 256]:
        out.append(("top_k_top_p", f"B={rows} V=151936", lambda r=rows: sampling_case(r, tk.top_k_top_p_min_p)))
        out.append(("  torch sort", f"B={rows} V=151936", lambda r=rows: sampling_case(r, reference.top_k_top_p_min_p)))
    return out


def prepare(builder: Callable) -> tuple[list[Callable], list[Callable] | None, int, int]:
    """The case's atom and reference calls over enough input copies (4x L2) to defeat the
    cache, its bytes and flops."""
    fn, ref, nbytes, flops = builder()
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    copies = min(64, max(1, -(-4 * l2 // max(nbytes, 1))))
    more = [builder()[:2] for _ in range(copies - 1)]
    refs = None if ref is None else [ref] + [r for _, r in more]
    return [fn] + [f for f, _ in more], refs, nbytes, flops


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
    """Reference time, ratio (reference / atom) and max abs difference of the outputs."""
    if refs is None:
        return {}
    diff = (fns[0]().float() - refs[0]().float()).abs().max().item()
    return dict(ref_ms=graph_ms(refs), diff=diff)


# --- config sweep -----------------------------------------------------------------------


def _cfgs(keys: str, rows: list[tuple]) -> list[dict]:
    return [dict(zip(keys.split(), r)) for r in rows]


def moe_sweep() -> list[dict]:
    """MoE GEMM tile configs (``down``: the down GEMM's own overrides; ``b_desc``: expert
    weight tiles through tensor descriptors), each patched in as the config of every size."""
    down = dict(BLOCK_N=256, num_warps=8, num_stages=4)
    moe_cfgs = _cfgs("BLOCK_M BLOCK_N BLOCK_K num_warps num_stages down b_desc", [
        (16, 64, 128, 4, 4, {}, True), (16, 128, 128, 4, 4, {}, True), (32, 64, 128, 4, 4, {}, True),
        (64, 128, 64, 4, 4, down, True), (128, 128, 64, 8, 4, down, True), (128, 128, 64, 8, 3, down, True),
        (128, 128, 64, 8, 4, {**down, "num_stages": 3}, True), (128, 64, 64, 8, 4, down, True)])  # fmt: skip
    rows = []
    for n in [1, 16, 512, 2048, 8192]:
        rows += _sweep_one(f"moe T={n}", lambda n=n: moe_case(n), moe, "_gemm_config", moe_cfgs)
    return rows


def prefill_sweep() -> list[dict]:
    """Prefill kernel variants: tile configs, register caps, and the chunk's own K/V read
    packed through tensor descriptors instead of gathered from the cache (``packed``)."""
    cfgs = _cfgs("block_m block_n num_warps num_stages maxnreg", [
        (128, 64, 8, 2, 128), (128, 64, 8, 3, 128), (128, 128, 8, 2, None), (128, 128, 8, 3, None),
        (64, 64, 4, 3, None), (64, 32, 4, 3, 168), (64, 64, 4, 2, 168), (256, 64, 8, 3, None)])  # fmt: skip
    variants = [(c, p) for c in cfgs for p in (False, True)]
    rows = []
    for q_len, ctx in [(2048, 0), (8192, 0), (512, 4096), (2048, 4096), (4096, 0), (1024, 1024)]:
        for cfg, packed in variants:

            def builder(cfg=cfg, packed=packed, q_len=q_len, ctx=ctx):
                q, k_cache, v_cache, cu, lens, tables = inputs = attention_inputs([q_len], [ctx])
                kv = new_kv(k_cache, v_cache, tables, [q_len], [ctx]) if packed else {}
                out, expect = torch.empty_like(q), tk.paged_attention(*inputs, 128**-0.5)
                scale = 128**-0.5 * 1.4426950408889634
                launch = prefill_attention.prefill_attention

                def fn():
                    return launch(q, out, k_cache, v_cache, cu, lens, tables, scale, cfg, **kv), out, expect

                return fn, None, *attention_cost(q, k_cache, [q_len], [ctx])

            try:
                fns, _, nbytes, flops = prepare(builder)
                kernel, out, expect = fns[0]()
                ms = graph_ms(fns, rep=30)
            except Exception as e:  # e.g. out of shared memory for a large tile
                print(f"  prefill {cfg} packed={packed}: {type(e).__name__}: {str(e)[:100]}")
                continue
            check = dict(regs=kernel.n_regs, spills=kernel.n_spills, smem=kernel.metadata.shared,
                         diff=(out.float() - expect.float()).abs().max().item())  # fmt: skip
            rows.append(dict(case=f"prefill q={q_len} ctx={ctx}", config={**cfg, "packed": packed, **check},
                             **row(ms, nbytes, flops)))  # fmt: skip
            del fns
        torch.cuda.empty_cache()
    return rows


def _sweep_one(name: str, builder: Callable, module, attr: str, cfgs: list) -> list[dict]:
    fns, _, nbytes, flops = prepare(builder)
    default, rows = getattr(module, attr), []
    try:
        for cfg in [None, *cfgs]:  # None: the default
            setattr(module, attr, default if cfg is None else (lambda *_, c=cfg: c))
            try:
                ms = graph_ms(fns, rep=30)
            except Exception as e:  # e.g. out of shared memory for a large tile
                print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:100]}")
                continue
            rows.append(dict(case=name, config="default" if cfg is None else cfg, **row(ms, nbytes, flops)))
    finally:
        setattr(module, attr, default)
    del fns
    torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-json", help="write all results here")
    parser.add_argument("--sweep", choices=["moe", "prefill"], nargs="*", default=[],
                        help="also time alternative tile configs of these kernels")  # fmt: skip
    parser.add_argument("--only", default="", help="run only the cases whose kernel name contains this")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    fa3, fused_experts = vllm_kernels()
    bw, tf = copy_gbps(), gemm_tflops()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s, bf16 matmul {tf:.0f} TFLOP/s; "
          f"references: FA3 {'yes' if fa3 else 'no'}, fused_experts {'yes' if fused_experts else 'no'}")  # fmt: skip
    results = []
    for kernel, shape, builder in cases():
        if args.only not in kernel:
            continue
        fns, refs, nbytes, flops = prepare(builder)
        r = dict(kernel=kernel, shape=shape, **row(graph_ms(fns), nbytes, flops), **compare(fns, refs))
        results.append(r)
        logging.info("%s %s: %s", kernel, shape, r)
        del fns, refs
        torch.cuda.empty_cache()

    sweep_rows = (moe_sweep() if "moe" in args.sweep else []) + (prefill_sweep() if "prefill" in args.sweep else [])
    if sweep_rows:
        print("\nsweep (best 2 per case, and the default):")
        for case in dict.fromkeys(r["case"] for r in sweep_rows):
            rows = sorted((r for r in sweep_rows if r["case"] == case), key=lambda r: r["ms"])
            for r in rows[:2] + [r for r in rows[2:] if r["config"] == "default"]:
                print(f"  {case:<22} {r['ms']:8.4f} ms {r['gbps']:6.0f} GB/s {r['tflops']:6.1f} TF  {r['config']}")
    print(f"\n{'kernel':<13} {'shape':<29} {'ms':>8} {'GB/s':>6} {'%copy':>5} {'TF/s':>6} {'%gemm':>5} "
          f"{'ref ms':>8} {'ratio':>6} {'diff':>7}")  # fmt: skip
    for r in results:
        tflops = f"{r['tflops']:6.1f} {100 * r['tflops'] / tf:4.0f}%" if r["tflops"] else " " * 12
        ref = f"{r['ref_ms']:8.4f} {r['ref_ms'] / r['ms']:6.2f} {r['diff']:7.4f}" if "ref_ms" in r else ""
        print(f"{r['kernel']:<13} {r['shape']:<29} {r['ms']:8.4f} {r['gbps']:6.0f} {100 * r['gbps'] / bw:4.0f}% "
              f"{tflops} {ref}")  # fmt: skip

    if args.output_json:
        machine = dict(device=torch.cuda.get_device_name(), copy_gbps=bw, bf16_matmul_tflops=tf)
        with open(args.output_json, "w") as f:
            json.dump(dict(machine=machine, results=results, sweep=sweep_rows), f, indent=2)


if __name__ == "__main__":
    main()
