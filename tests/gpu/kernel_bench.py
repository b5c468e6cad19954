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

MLA decode (``--only mla``; DeepSeek-V3's 128 heads and V2-Lite / Moonlight's 16, latent 512 + rope 64, a
bf16 and an fp8 latent cache) runs against the decode kernels of vLLM's MLA backends on Hopper, each called
with the arguments its ``forward_mqa`` passes, on the same tokens (each in its own cache layout): one row
per backend below atom's. GB/s counts the latent rows read once; ``fp32 diff`` is the max abs difference
from atom's PyTorch reference (``atom.ops.mla.mla_decode``) in float32.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import itertools
import logging
from collections.abc import Callable
from types import SimpleNamespace

import torch
import triton

from atom.benchmarks.benchmark_utils import add_arguments, write_to_json
from atom.benchmarks.model_configs import copy_bandwidth
from atom.ops import mla as mla_reference
from atom.ops import reference_fp8
from atom.ops import triton as tk
from atom.ops.reference import to_cache_dtype
from atom.ops.triton.moe_fp8 import fused_moe_fp8

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
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


@functools.cache
def vllm_fp8_moe_config() -> Callable | None:
    """vLLM's ``fp8_w8a8_moe_quant_config`` (its fused_experts' FP8 arguments), or None where missing."""
    with contextlib.suppress(ImportError):
        from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

        return fp8_w8a8_moe_quant_config
    return None


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


def attention_case(q_lens, context_lens, packed=False, num_decode_tokens=0, num_kv_heads=8, max_seqlen_k=None,
                   num_splits=None):  # fmt: skip
    """``packed``: also pass the new tokens' K/V packed (prefill reads them through descriptors).
    ``max_seqlen_k``: as a decode graph passes it (its max_model_len; default the batch's longest), to
    both kernels; ``num_splits``: atom's split override."""
    q, k_cache, v_cache, cu, lens, tables = attention_inputs(q_lens, context_lens, num_kv_heads=num_kv_heads)
    scale, max_q = q.shape[2] ** -0.5, max(q_lens)
    max_k = max_seqlen_k or max(c + n for c, n in zip(context_lens, q_lens))
    kv = new_kv(k_cache, v_cache, tables, q_lens, context_lens) if packed else {}
    args = (q, k_cache, v_cache, cu, lens, tables, scale, max_q, max_k)
    ref, fa3 = None, vllm_kernels()[0]
    if fa3 is not None:  # vLLM's cache layout [blocks, block_size, kv_heads, head_dim], same values
        k_fa, v_fa = (c.permute(0, 2, 1, 3).contiguous() for c in (k_cache, v_cache))
        fa_args = dict(max_seqlen_q=max_q, cu_seqlens_q=cu, max_seqlen_k=max_k, seqused_k=lens, softmax_scale=scale)
        fa_args.update(causal=True, block_table=tables, out=torch.empty_like(q), fa_version=3)
        ref = functools.partial(fa3, q, k_fa, v_fa, **fa_args)
    fn = functools.partial(tk.paged_attention, *args, num_decode_tokens=num_decode_tokens, num_splits=num_splits, **kv)
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


def moe_fp8_case(num_tokens, hidden=2048, inter=768, num_experts=128, top_k=8, config=None):
    """Qwen3-30B-A3B-FP8's experts (e4m3 weights with 128 x 128 block scales, activations quantised in
    1 x 128 groups): atom's ``fused_moe_fp8`` (``config``: its tiles, the table's when None) and vLLM's
    ``fused_experts`` with the same weights and block scales (as its TRITON FP8 MoE backend runs them)."""
    x = torch.randn(num_tokens, hidden, dtype=BF16, device=DEV)
    quantized = []
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):
        w = torch.randn(num_experts * rows, cols, device=DEV) * cols**-0.5
        q, scale = reference_fp8.quantize_weight(w, 128, 128)  # rows are a multiple of 128: per expert
        quantized.append((q.view(num_experts, rows, cols), scale.view(num_experts, rows, -1)))
    (w13, s13), (w2, s2) = quantized
    weights, ids = tk.moe_topk(torch.randn(num_tokens, num_experts, device=DEV), top_k, True)
    ref, fused_experts, quant_config = None, vllm_kernels()[1], vllm_fp8_moe_config()
    if fused_experts is not None and quant_config is not None:  # block scales: one row of each 128
        cfg = quant_config(
            w1_scale=s13[:, ::128].contiguous(), w2_scale=s2[:, ::128].contiguous(), block_shape=[128, 128]
        )
        ref = functools.partial(fused_experts, x, w13, w2, weights, ids.to(torch.int32), quant_config=cfg)
    fn = functools.partial(fused_moe_fp8, x, w13, s13, w2, s2, weights, ids, 128, config=config)
    weight_bytes = ids.unique().numel() * 3 * hidden * inter  # one byte a weight, only the experts used
    return fn, ref, weight_bytes + 2 * x.nbytes, 2 * num_tokens * top_k * 3 * hidden * inter


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


SAMPLE_BASELINE: list[Callable] = []  # --sample-baseline: an earlier atom's sample_tokens, timed as a reference


def sampling_case(rows, ref, vocab=151936, plain=False, top_p_only=False):
    """float32 logits, temperature 0.8, top_k=50 top_p=0.9 (Qwen3 recommends 20 / 0.95), top_p=0.9
    only (``top_p_only``: the sort reference keeps all k), or temperature only (``plain``): atom's
    kernel against ``ref`` (and ``SAMPLE_BASELINE``); the floor is reading the logits once."""
    logits, temps = torch.randn(rows, vocab, device=DEV) * 3, torch.full((rows,), 0.8, device=DEV)
    top_k, top_p = torch.full((rows,), SAMPLE_TOP_K, device=DEV), torch.full((rows,), 0.9, device=DEV)
    seeds = torch.randint(1 << 62, (rows,), device=DEV)
    if plain:
        top_k = top_p = None
    args = (logits, temps, None if top_p_only else top_k, top_p, None, seeds)
    refs = {"atom baseline": functools.partial(SAMPLE_BASELINE[0], *args)} if SAMPLE_BASELINE else {}
    if top_p_only:
        top_k = torch.full((rows,), vocab, device=DEV)
    refs[""] = functools.partial(ref, logits, temps, top_k, top_p)
    return functools.partial(tk.sample_tokens, *args), refs, logits.nbytes, 0


# --- MLA decode: atom's kernel against the decode kernels of vLLM 0.26's MLA backends on Hopper. vLLM's
# priority there is FLASH_ATTN_MLA, FLASHMLA, (FLASHINFER_MLA: sm100 only), TRITON_MLA: a bf16 cache gets
# FLASH_ATTN_MLA (block size 16); it has no fp8 cache, so an fp8 cache gets FLASHMLA (block size 64)
# where vLLM's FlashMLA extensions load, else TRITON_MLA (block size 16).

MLA_RANK, MLA_ROPE = 512, 64
MLA_SCALE = (128 + 64) ** -0.5  # qk_nope_head_dim + qk_rope_head_dim (without DeepSeek-V3's yarn factor)
FA3_SPLITS = 32  # vLLM's flash_attn_max_num_splits_for_cuda_graph: its decode batches run in full CUDA graphs
EXACT = "float32 reference"  # a case's refs entry that is checked against, not timed


@functools.cache
def vllm_mla() -> dict[str, object]:
    """vLLM's MLA decode entry points by backend name, or the reason one is missing (a str)."""
    found = {}
    try:
        from vllm.v1.attention.backends.fa_utils import flash_attn_supports_mla
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

        ok = flash_attn_supports_mla()
        found["FLASH_ATTN_MLA"] = (flash_attn_varlen_func, get_scheduler_metadata) if ok else "not supported here"
    except Exception as e:  # ImportError, or no CUDA platform
        found["FLASH_ATTN_MLA"] = f"{type(e).__name__}: {e}"
    try:
        from vllm.v1.attention.ops import flashmla

        ok, why = flashmla.is_flashmla_dense_supported()
        found["FLASHMLA"] = flashmla if ok else why
    except Exception as e:
        found["FLASHMLA"] = f"{type(e).__name__}: {e}"
    try:
        from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

        found["TRITON_MLA"] = decode_attention_fwd
    except Exception as e:
        found["TRITON_MLA"] = f"{type(e).__name__}: {e}"
    return found


def paged(tokens: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` [B, S, D] in a paged cache [blocks, block_size, D] (unused rows zero, as vLLM allocates
    its cache), each sequence's blocks scattered: (cache, block_tables)."""
    batch, seq_len, dim = tokens.shape
    max_blocks = -(-seq_len // block_size)
    tables = torch.randperm(batch * max_blocks, dtype=torch.int32, device=DEV).view(batch, max_blocks)
    cache = torch.zeros(batch * max_blocks, block_size, dim, dtype=tokens.dtype, device=DEV)
    offs = torch.arange(block_size, device=DEV)
    slots = (tables.long()[:, :, None] * block_size + offs).flatten(1)[:, :seq_len]
    cache.view(-1, dim)[slots] = tokens
    return cache, tables


def mla_inputs(batch: int, context: int, num_heads: int, fp8: bool) -> SimpleNamespace:
    """One decode token per sequence over ``context`` cached ones (its own row included in the cache), the
    query as vLLM's MLA layer hands it over: ``q_nope`` (W_UK absorbed) a [B, H, 512] view of [H, B, 512],
    ``q_pe`` a slice of the [B, H, 192] query; ``q`` the two concatenated (atom's input). The same latent
    rows in a block-16 cache (atom, FLASH_ATTN_MLA, TRITON_MLA) and a block-64 one (FLASHMLA); an fp8
    cache holds them divided by ``k_scale``."""
    seq_len = context + 1
    q_nope = torch.randn(num_heads, batch, MLA_RANK, dtype=BF16, device=DEV).transpose(0, 1)
    q_pe = torch.randn(batch, num_heads, 128 + MLA_ROPE, dtype=BF16, device=DEV)[..., 128:]
    k_scale = torch.tensor([0.5], device=DEV) if fp8 else None  # randn latents: far inside e4m3's range
    tokens = to_cache_dtype(torch.randn(batch, seq_len, MLA_RANK + MLA_ROPE, device=DEV), FP8 if fp8 else BF16, k_scale)
    tokens = tokens.view(torch.uint8) if fp8 else tokens  # index_put has no float8 kernels
    caches = {bs: paged(tokens, bs) for bs in (16, 64)}
    caches = {bs: (c.view(FP8) if fp8 else c, t) for bs, (c, t) in caches.items()}
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=DEV)
    q = torch.cat((q_nope, q_pe), dim=-1)
    return SimpleNamespace(q=q, q_nope=q_nope, q_pe=q_pe, caches=caches, seq_lens=seq_lens, k_scale=k_scale)


def fa3_mla_call(x: SimpleNamespace, page: int = 16) -> Callable:
    """FLASH_ATTN_MLA: FA3 with the latent as V and the rope part as K, ``q_v`` the absorbed query; scheduler
    metadata built once per step (shared by the layers), as its metadata builder does. ``page``: the
    cache's block size (vLLM's default for this backend: 16)."""
    fa3, scheduler_metadata = vllm_mla()["FLASH_ATTN_MLA"]
    (batch, num_heads), (cache, tables) = x.q.shape[:2], x.caches[page]
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    max_len = int(x.seq_lens.max())
    meta = scheduler_metadata(
        batch_size=batch, max_seqlen_q=1, max_seqlen_k=max_len, num_heads_q=num_heads, num_heads_kv=1,
        headdim=MLA_ROPE, cache_seqlens=x.seq_lens, qkv_dtype=BF16, headdim_v=MLA_RANK, page_size=page,
        cu_seqlens_q=cu, causal=True, num_splits=FA3_SPLITS,
    )  # fmt: skip
    k_pe, kv_c = cache[..., MLA_RANK:].unsqueeze(-2), cache[..., :MLA_RANK].unsqueeze(-2)
    return functools.partial(
        fa3, q=x.q_pe, k=k_pe, v=kv_c, q_v=x.q_nope, max_seqlen_q=1, cu_seqlens_q=cu, max_seqlen_k=max_len,
        seqused_k=x.seq_lens, block_table=tables, softmax_scale=MLA_SCALE, causal=True, fa_version=3,
        scheduler_metadata=meta, num_splits=FA3_SPLITS,
    )  # fmt: skip


def flashmla_call(x: SimpleNamespace) -> Callable:
    """FLASHMLA: FlashMLA's dense decode over the block-64 cache, q [B, 1, H, 576]; an fp8 cache takes an
    fp8 query (vLLM quantises it with the layer's q_scale, 1.0 without a checkpoint scale) and scheduler
    metadata from ``get_mla_metadata_dense_fp8``."""
    fm = vllm_mla()["FLASHMLA"]
    num_heads, (cache, tables) = x.q.shape[1], x.caches[64]
    args = dict(k_cache=cache.unsqueeze(-2), block_table=tables, cache_seqlens=x.seq_lens, head_dim_v=MLA_RANK)
    args.update(softmax_scale=MLA_SCALE, causal=True)
    if x.k_scale is None:
        meta, _ = fm.get_mla_metadata(x.seq_lens, num_heads, 1, is_fp8_kvcache=False)
        call = functools.partial(fm.flash_mla_with_kvcache, q=x.q.unsqueeze(1), tile_scheduler_metadata=meta, **args)
    else:
        q_scale = torch.ones(1, device=DEV)
        tiles, splits = fm.get_mla_metadata_dense_fp8(x.seq_lens, num_heads, 1)
        q8 = to_cache_dtype(x.q, FP8, q_scale).unsqueeze(1)  # vLLM's separate quantisation op, not timed
        args.update(tile_scheduler_metadata=tiles, num_splits=splits, descale_q=q_scale, descale_k=x.k_scale)
        call = functools.partial(fm.flash_mla_with_kvcache_fp8, q=q8, **args)
    return lambda: call()[0].squeeze(1)


def triton_mla_call(x: SimpleNamespace) -> Callable:
    """TRITON_MLA: vLLM's grouped Triton decode (its ``forward_mqa``: zeroed output and LSE, split count
    from the longest sequence), a bf16 query over the block-16 cache."""
    decode = vllm_mla()["TRITON_MLA"]
    (batch, num_heads), (cache, tables) = x.q.shape[:2], x.caches[16]
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    splits = min(triton.next_power_of_2(max(1, int(x.seq_lens.max()) // 512)), 2 * sms)
    logits = torch.empty(batch, num_heads, splits, MLA_RANK + 1, device=DEV)
    kv = cache.unsqueeze(2)
    scale = torch.ones(1, device=DEV) if x.k_scale is None else x.k_scale

    def call():
        o = torch.zeros(batch, num_heads, MLA_RANK, dtype=x.q.dtype, device=DEV)
        lse = torch.zeros(batch, num_heads, dtype=x.q.dtype, device=DEV)
        decode(x.q, kv, kv[..., :MLA_RANK], o, lse, tables, x.seq_lens, logits, splits, MLA_SCALE, 16,
               k_scale=scale, v_scale=scale, is_mla=True)  # fmt: skip
        return o

    return call


MLA_BASELINE: list[Callable] = []  # --mla-baseline: an earlier atom's mla_decode, timed as one more reference


def load_baseline(path: str, name: str) -> Callable:
    """``name`` of the file ``path``, an earlier atom kernel module (e.g. main's atom/ops/triton/mla.py)."""
    spec = importlib.util.spec_from_file_location(f"baseline_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


MLA_MODELS = [("V3", 128), ("V2-Lite", 16)]  # DeepSeek-V3 at -tp 1 (16 heads: V3 at -tp 8, V2-Lite, Moonlight)
MLA_REFS = {False: {"FLASH_ATTN_MLA": fa3_mla_call, "FLASHMLA": flashmla_call,
                    "FLASH_ATTN_MLA@64": functools.partial(fa3_mla_call, page=64)},
            True: {"FLASHMLA": flashmla_call, "TRITON_MLA": triton_mla_call}}  # fmt: skip
_mla_failed: set[str] = set()


def mla_case(batch: int, context: int, num_heads: int, fp8: bool = False):
    """atom's ``mla_decode`` (over the block-16 cache) and the vLLM backends of ``MLA_REFS`` that load
    (vLLM's pick first), and the float32 reference (``EXACT``); bytes: the latent rows once, q and out."""
    x = mla_inputs(batch, context, num_heads, fp8)
    cache, tables = x.caches[16]
    args = (x.q, cache, x.seq_lens, tables, MLA_SCALE, MLA_RANK, x.k_scale)
    fn = functools.partial(tk.mla_decode, *args)
    refs = {}
    for name, make in MLA_REFS[fp8].items():
        if not isinstance(vllm_mla()[name.split("@")[0]], str) and name not in _mla_failed:  # @64: block 64
            try:
                refs[name] = make(x)
            except Exception as e:  # reported once, then skipped
                logging.warning("%s: %s: %s", name, type(e).__name__, e)
                _mla_failed.add(name)
    for baseline in MLA_BASELINE:
        refs["atom baseline"] = functools.partial(baseline, *args)
    # atom over block-64 pages (FlashMLA's block size): ratio < 1 where they are faster than block-16 pages
    cache64, tables64 = x.caches[64]
    refs["atom@64"] = functools.partial(tk.mla_decode, x.q, cache64, x.seq_lens, tables64, *args[4:])
    refs[EXACT] = functools.partial(mla_reference.mla_decode, x.q.float(), *args[1:])
    rows = batch * (context + 1)
    nbytes = rows * cache[0, 0].nbytes + x.q.nbytes + batch * num_heads * MLA_RANK * x.q.element_size()
    return fn, refs, nbytes, 2 * num_heads * (2 * MLA_RANK + MLA_ROPE) * rows  # QK^T over 576 dims, PV over 512


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
    # DeepSeek-V2-Lite's routed experts (64 of 1408 columns, top-6): decode batches read every expert
    v2 = dict(inter=1408, num_experts=64, top_k=6)
    out += [("fused_moe", f"T={n} E=64 top6 I=1408", case(moe_case, n, **v2)) for n in [1, 64, 256, 1024, 4096]]
    out += [("fused_moe fp8", f"T={n} E=128 top8", case(moe_fp8_case, n)) for n in [1, 16, 128, 512, 2048, 8192]]
    out += [("rms_norm+res", f"T={n} H=4096", case(rms_norm_case, n)) for n in [1, 512, 8192]]
    for rows, vocab in [(r, 151936) for r in [1, 4, 8, 32, 64, 256]] + [(256, 128256), (256, 49152)]:
        out.append(("sample", f"B={rows} V={vocab} vs sort", case(sampling_case, rows, sort_sample, vocab)))
        out.append(("sample", "  vs torch.topk", case(sampling_case, rows, topk_sample, vocab)))
    for rows in [1, 8, 64]:
        out.append(("sample", f"B={rows} top-p only vs sort", case(sampling_case, rows, sort_sample, top_p_only=True)))
    for rows in [1, 4, 8, 64, 256]:
        out.append(("sample", f"B={rows} temperature only", case(sampling_case, rows, plain_sample, plain=True)))
    mla_shapes = [*itertools.product([1, 8, 32, 64, 128], [1024, 4096, 8192]), (1, 32768), (8, 32768)]
    for (model, heads), fp8, (b, c) in itertools.product(MLA_MODELS, [False, True], mla_shapes):
        label = f"{model} b={b} ctx={c // 1024}k"
        out.append((f"mla {'fp8' if fp8 else 'bf16'}", label, case(mla_case, b, c, heads, fp8)))
    return out


def prepare(builder: Callable) -> tuple[list[Callable], dict[str, list[Callable]], int, int]:
    """The case's atom call and references (by name; an unnamed one is "") over enough input copies (4x L2)
    to defeat the cache, its bytes and flops."""
    fn, ref, nbytes, flops = builder()
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    more = [builder()[:2] for _ in range(min(64, max(1, -(-4 * l2 // max(nbytes, 1)))) - 1)]
    named = [{} if r is None else r if isinstance(r, dict) else {"": r} for r in [ref] + [r for _, r in more]]
    return [fn] + [f for f, _ in more], {name: [r[name] for r in named] for name in named[0]}, nbytes, flops


def captured(fns: list[Callable]) -> torch.cuda.CUDAGraph:
    """All ``fns`` in one CUDA graph, each run once before (compiled and allocated outside the capture)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return graph


def graph_ms(fns: list[Callable], rep: int = 100) -> float:
    """Device time per call: all ``fns`` captured in one CUDA graph, replays timed."""
    return bench_ms(captured(fns).replay, rep) / len(fns)


def row(ms: float, nbytes: int, flops: int) -> dict:
    return dict(ms=ms, gbps=nbytes / ms / 1e6, tflops=flops / ms / 1e9)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def compare(fns: list[Callable], refs: dict[str, list[Callable]], nbytes: int, flops: int) -> dict:
    """Each reference's time and the max abs difference of its output from atom's; with an ``EXACT``
    entry (computed once, not timed), every output's difference from it too. The unnamed reference goes
    into ``ref_ms`` / ``diff``, named ones into ``refs``."""
    if not refs:
        return {}
    out, exact = fns[0](), refs.pop(EXACT, [None])[0]
    exact = exact and exact()
    result = {} if exact is None else dict(fp32_diff=max_diff(out, exact))
    for name, calls in refs.items():
        try:
            ref = calls[0]()
            # sampled tokens (different noise): no diff
            diff = max_diff(out, ref) if out.is_floating_point() else float("nan")
            timed = dict(ms=graph_ms(calls), diff=diff)
        except Exception as e:  # a vLLM kernel refusing these inputs: reported, the others still run
            logging.warning("%s: %s: %s", name, type(e).__name__, e)
            result.setdefault("refs", {})[name] = dict(error=f"{type(e).__name__}: {e}")
            continue
        if name == "":
            result.update(ref_ms=timed["ms"], diff=diff)
        else:
            timed |= {} if exact is None else dict(fp32_diff=max_diff(ref, exact))
            result.setdefault("refs", {})[name] = row(timed["ms"], nbytes, flops) | timed
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    only = ("--only", "", "run only the cases whose kernel name contains this")
    baseline = ("--mla-baseline", str, "also time the mla_decode of this file (an earlier atom/ops/triton/mla.py)")
    sample = ("--sample-baseline", str, "also time the sample_tokens of this file (an earlier sampling_fused.py)")
    add_arguments(parser, [("--output-json", str, "write all results here"), only, baseline, sample])
    args = parser.parse_args()
    MLA_BASELINE.extend([load_baseline(args.mla_baseline, "mla_decode")] if args.mla_baseline else [])
    SAMPLE_BASELINE.extend([load_baseline(args.sample_baseline, "sample_tokens")] if args.sample_baseline else [])
    logging.basicConfig(level=logging.INFO)
    fa3, fused_experts = vllm_kernels()
    bw, tf = copy_bandwidth() / 1e9, gemm_tflops()
    mla = ", ".join(f"{k} {'no' if isinstance(v, str) else 'yes'}" for k, v in vllm_mla().items())
    refs = f"FA3 {'yes' if fa3 else 'no'}, fused_experts {'yes' if fused_experts else 'no'}, MLA: {mla}"
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s, bf16 matmul {tf:.0f} TFLOP/s; references: {refs}")
    for name, why in vllm_mla().items():
        if isinstance(why, str):
            print(f"  {name} not loaded: {why}")
    results = []
    for kernel, shape, builder in (c for c in cases() if args.only in c[0]):
        fns, refs, nbytes, flops = prepare(builder)
        results.append(dict(kernel=kernel, shape=shape, **row(graph_ms(fns), nbytes, flops)))
        results[-1] |= compare(fns, refs, nbytes, flops)
        logging.info("%s %s: %s", kernel, shape, results[-1])
        del fns, refs
        torch.cuda.empty_cache()

    def line(kernel: str, shape: str, r: dict, ref: str) -> None:
        tflops = f"{r['tflops']:6.1f} {100 * r['tflops'] / tf:4.0f}%" if r["tflops"] else " " * 12
        gbps = f"{r['gbps']:6.0f} {100 * r['gbps'] / bw:4.0f}%"
        fp32 = f" {r['fp32_diff']:9.4f}" if "fp32_diff" in r else ""
        print(f"{kernel:<13} {shape:<29} {r['ms']:8.4f} {gbps} {tflops} {ref}{fp32}")

    head = ("kernel", "shape", "ms", "GB/s", "%copy", "TF/s", "%gemm", "ref ms", "ratio", "diff", "fp32 diff")
    print("\n{:<13} {:<29} {:>8} {:>6} {:>5} {:>6} {:>5} {:>8} {:>6} {:>7} {:>9}".format(*head))
    for r in results:
        ref = f"{r['ref_ms']:8.4f} {r['ref_ms'] / r['ms']:6.2f} {r['diff']:7.4f}" if "ref_ms" in r else ""
        ref = ref or (" " * 23 if "fp32_diff" in r else "")  # MLA rows: their fp32 diff in its column
        line(r["kernel"], r["shape"], r, ref)
        for name, v in r.get("refs", {}).items():  # named references (vLLM's, baselines), ratio = theirs / atom's
            if "error" in v:
                print(f"{'':<13} {'  ' + name}: {v['error'][:100]}")
            else:
                line("", f"  {name}", v, f"{'':8} {v['ms'] / r['ms']:6.2f} {v['diff']:7.4f}")
    if args.output_json:
        machine = dict(device=torch.cuda.get_device_name(), copy_gbps=bw, bf16_matmul_tflops=tf)
        write_to_json(args.output_json, dict(machine=machine, results=results), indent=2)


if __name__ == "__main__":
    main()
