"""Alternative tile configs of atom's MoE GEMMs (bf16 and FP8), prefill attention and MLA decode kernels, and the
decode attention's split-K factor, timed as ``tests/gpu/kernel_bench.py`` times its cases (how the defaults in
``atom.ops.triton`` were picked). GPU only:

    python tests/gpu/kernel_sweep.py [moe] [moe_small] [moe_fp8] [moe_fp8_gemv] [moe_gemv] [prefill] [mla] \
        [mla_prefill] [decode] [decode_varlen] [--output-json sweep.json]

Prints the best two configs per case and the default; ``--output-json`` writes every row
(case, config, ms, GB/s, TFLOP/s; prefill rows also the compiler's resource report and the max abs
difference from ``paged_attention``, MLA rows from the float32 reference). Configs that cannot run
here (e.g. out of shared memory) are reported and skipped.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable

import torch

# tests/gpu/kernel_bench.py: python puts this script's directory on sys.path
from kernel_bench import (
    EXACT,
    attention_case,
    attention_cost,
    attention_inputs,
    graph_ms,
    max_diff,
    mla_case,
    moe_case,
    moe_fp8_case,
    new_kv,
    prepare,
    row,
)

from atom.benchmarks.benchmark_utils import write_to_json
from atom.ops import mla as mla_reference
from atom.ops import triton as tk
from atom.ops.triton import mla, mla_prefill, moe, prefill_attention
from atom.ops.triton.fp8_configs import moe_config
from atom.ops.triton.fp8_gemv import Fp8GemvConfig
from atom.ops.triton.moe_gemv import MoeGemvConfig


def _cfgs(keys: str, rows: list[tuple]) -> list[dict]:
    return [dict(zip(keys.split(), r)) for r in rows]


def _timed(case: str, config, prepared: Callable, check: Callable | None = None) -> dict | None:
    """One sweep row, or None (reported) where the config cannot run, e.g. out of shared memory."""
    try:
        fns, _, nbytes, flops = prepared()
        if check:  # its findings (registers, spills, error) join the config's fields
            config = {**({"default": True} if config == "default" else config), **check(fns)}
        return dict(case=case, config=config, **row(graph_ms(fns, rep=30), nbytes, flops))
    except Exception as e:
        print(f"  {case} {config}: {type(e).__name__}: {str(e)[:100]}")
    finally:
        torch.cuda.empty_cache()


def moe_sweep(small: bool = False) -> list[dict]:
    """MoE GEMM tile configs (``down``: the down GEMM's own overrides; ``b_desc``: expert weight tiles
    through tensor descriptors), each patched in as the config of every size, and vLLM's
    ``fused_experts`` on the same inputs where it is importable (config ``vllm``). ``small``: decode
    batches only (1-16 tokens)."""
    down = dict(BLOCK_N=256, num_warps=8, num_stages=4)
    sorted_keys = "BLOCK_M BLOCK_N BLOCK_K num_warps num_stages down b_desc"
    cfgs = _cfgs(
        sorted_keys,
        [
            (16, 64, 128, 4, 4, {}, True),
            (16, 128, 128, 4, 4, {}, True),
            (32, 64, 128, 4, 4, {}, True),
            (64, 128, 64, 4, 4, down, True),
            (128, 128, 64, 8, 4, down, True),
            (128, 128, 64, 8, 3, down, True),
            (128, 128, 64, 8, 4, {**down, "num_stages": 3}, True),
            (128, 64, 64, 8, 4, down, True),
            (64, 64, 64, 4, 3, {}, True),  # vLLM's default tile at M 97-512
            (128, 128, 64, 8, 3, {}, True),  # vLLM's default tile above 512 tokens
        ],
    )
    cfgs += [{**cfgs[4], "GROUP_M": g} for g in (8, 16)]  # the large tile, row tiles in groups (_tile_ids)
    # Qwen3-30B-A3B's experts (128 of 768 columns, top-8), then DeepSeek-V2-Lite's (64 of 1408, top-6)
    shapes = [(n, {}) for n in [1, 16, 512, 2048, 8192]]
    shapes += [(n, dict(inter=1408, num_experts=64, top_k=6)) for n in [256, 1024, 4096]]
    if small:  # decode tiles, the routed experts of Qwen3-30B-A3B, DeepSeek-V2-Lite and V3
        cfgs = cfgs[:2] + _cfgs(sorted_keys, [(16, 32, 128, 4, 4, {}, True), (16, 64, 64, 4, 5, {}, True)])
        shapes = [(n, {}) for n in [1, 2, 4, 8, 16]]
        shapes += [(n, dict(inter=1408, num_experts=64, top_k=6)) for n in [1, 2, 4]]
        shapes += [(n, dict(hidden=7168, inter=2048, num_experts=256, top_k=8)) for n in [1, 8]]
    rows, default = [], moe._gemm_config
    for n, experts in shapes:
        prepared = prepare(functools.partial(moe_case, n, **experts))
        label = f"moe T={n}" + (f" E={experts['num_experts']}" if experts else "")
        try:
            for cfg in [None, *cfgs]:  # None: the default
                moe._gemm_config = default if cfg is None else (lambda *_, c=cfg: c)
                rows.append(_timed(label, cfg or "default", lambda p=prepared: p))
        finally:
            moe._gemm_config = default
        if refs := prepared[1].get(""):
            rows.append(_timed(label, "vllm", lambda p=prepared, r=refs: (r, {}, *p[2:])))
        del prepared
    return [r for r in rows if r]


def moe_fp8_sweep() -> list[dict]:
    """The FP8 MoE's tiles at Qwen3-30B-A3B-FP8's experts (block-128 weights; ``down``: the down GEMM's
    overrides), each passed as ``fused_moe_fp8(config=...)``, beside the table's pick (``default``) and
    vLLM's FP8 ``fused_experts`` on the same weights (``vllm``)."""
    # paired: gate and up in one dot; the first and the seventh: the tiles before session 30
    down = {"BLOCK_N": 128}
    cfgs = _cfgs(
        "BLOCK_M BLOCK_N num_warps num_stages GROUP_M paired down",
        [
            (16, 64, 4, 3, 0, False, {}),
            (16, 64, 4, 3, 0, True, {}),
            (16, 32, 4, 3, 0, True, {}),
            (16, 64, 4, 5, 0, True, {}),
            (16, 128, 4, 3, 0, True, {}),
            (32, 64, 4, 4, 0, True, {}),
            (64, 64, 4, 4, 0, False, down),
            (64, 64, 4, 4, 8, False, down),
            (64, 64, 4, 4, 8, True, down),
            (64, 64, 4, 3, 8, True, down),
            (64, 64, 4, 4, 0, True, down),
            (64, 32, 4, 4, 8, True, down),
            (64, 128, 8, 4, 8, True, down),
        ],
    )
    # the 16-row tile's row tiles in groups, as vLLM's table at 4-96 tokens (GROUP_SIZE_M 16-32; 16 the default)
    cfgs += [{**cfgs[1], "GROUP_M": 32}]
    rows = []
    for n in [1, 16, 128, 256, 512, 2048, 8192]:  # 256: vLLM switches to 64-row tiles there
        label = f"moe fp8 T={n}"
        fns, refs, nbytes, flops = prepare(functools.partial(moe_fp8_case, n))
        for cfg in [None, *cfgs]:
            if cfg and (cfg["BLOCK_M"] > 32 if n <= 16 else cfg["BLOCK_M"] < 32 and n >= 2048):
                continue  # tiles far from the rows per expert
            calls = [functools.partial(f, config=cfg) for f in fns]
            rows.append(_timed(label, cfg or "default", lambda c=calls, b=nbytes, f=flops: (c, {}, b, f)))
        if refs.get(""):
            rows.append(_timed(label, "vllm", lambda r=refs[""], b=nbytes, f=flops: (r, {}, b, f)))
        del fns, refs
    return [r for r in rows if r]


def _gemv(gated: tuple, down: tuple) -> MoeGemvConfig:
    return MoeGemvConfig(Fp8GemvConfig(*gated), Fp8GemvConfig(*down))


# the few-token FP8 MoE's GEMV launches: (block_n, block_k, num_warps) of the gated and the down GEMV; the
# first is the default, the second session 34's. Session 34 also had the down GEMV sum a token's experts in
# one program: 1.6x slower.
MOE_GEMV_CANDIDATES = [
    _gemv((8, 1024, 4), (8, 256, 2)),
    _gemv((16, 1024, 4), (8, 256, 2)),
    _gemv((4, 1024, 2), (8, 256, 2)),
    _gemv((8, 1024, 4), (4, 256, 2)),
    _gemv((8, 1024, 4), (8, 512, 4)),
    _gemv((8, 2048, 8), (8, 256, 2)),
    _gemv((8, 1024, 4), (16, 256, 4)),
]


def gemv_label(c: MoeGemvConfig) -> str:
    g, d = c.gated, c.down
    return f"gemv {g.block_n}x{g.block_k}w{g.num_warps} down {d.block_n}x{d.block_k}w{d.num_warps}"


def moe_fp8_gemv_sweep() -> list[dict]:
    """The few-token FP8 MoE: the CUDA-core GEMVs' launches (``MOE_GEMV_CANDIDATES``, to 16 tokens) against the
    tile kernels (``tiles``: the table's tile at that size) and vLLM's ``fused_experts``, at Qwen3-30B-A3B-FP8's
    experts (1-2,048 tokens), DeepSeek-V2-Lite's (64 of 1,408 columns, top-6) and Qwen3-235B-A22B's (hidden
    4,096, 1,536 columns) at 1 and 2 tokens (around ``MOE_GEMV_MAX_EXPERT_WEIGHTS``), and DeepSeek-V3's (1 and 4
    tokens); ``default``: what ``fused_moe_fp8`` picks, timed first and again last (the order's share)."""
    rows = []
    # DeepSeek-V3: 32 of its 256 experts (the float32 weights drawn for 256 would take ~90 GB)
    shapes = {"": {}, " V2-Lite": dict(inter=1408, num_experts=64, top_k=6),
              " 235B": dict(hidden=4096, inter=1536), " V3": dict(hidden=7168, inter=2048, num_experts=32)}  # fmt: skip
    cases = [(n, "") for n in (1, 2, 4, 8, 16, 64, 128, 256, 512, 2048)]
    cases += [(1, " V2-Lite"), (2, " V2-Lite"), (1, " 235B"), (2, " 235B"), (1, " V3"), (4, " V3")]
    for n, shape in cases:
        label, experts = f"moe fp8 T={n}{shape}", shapes[shape]
        fns, refs, nbytes, flops = prepare(functools.partial(moe_fp8_case, n, **experts))
        tiles = moe_config(n * experts.get("top_k", 8) / experts.get("num_experts", 128), True)
        cfgs = [("default", None), ("tiles", tiles)]
        cfgs += [(gemv_label(c), c) for c in MOE_GEMV_CANDIDATES] if n <= 16 else []
        for name, cfg in cfgs + [("default, again", None)]:
            calls = [functools.partial(f, config=cfg) for f in fns]
            rows.append(_timed(label, name, lambda c=calls, b=nbytes, f=flops: (c, {}, b, f)))
        if refs.get(""):
            rows.append(_timed(label, "vllm", lambda r=refs[""], b=nbytes, f=flops: (r, {}, b, f)))
        del fns, refs
    return [r for r in rows if r]


# the same for bf16 experts (twice the bytes a row); the first is the default (moe.GEMV_CONFIG)
MOE_GEMV_CANDIDATES_BF16 = [
    _gemv((2, 1024, 2), (4, 256, 2)),
    _gemv((4, 1024, 2), (4, 256, 2)),
    _gemv((2, 1024, 2), (2, 256, 2)),
    _gemv((2, 2048, 4), (4, 256, 2)),
    _gemv((2, 1024, 2), (8, 256, 2)),
    _gemv((4, 1024, 2), (2, 512, 2)),
    _gemv((8, 1024, 4), (4, 256, 2)),
]


def moe_gemv_sweep() -> list[dict]:
    """The few-token bf16 MoE: the GEMV launches (``MOE_GEMV_CANDIDATES_BF16``, passed as ``fused_moe(gemv=)``)
    against the tile kernels (``tiles``; ``default``: what ``fused_moe`` picks) and vLLM's ``fused_experts``, at
    Qwen3-30B-A3B's experts (1-4 tokens), DeepSeek-V2-Lite's / Moonlight's (64 of 1,408 columns, top-6),
    Qwen3-235B-A22B's (hidden 4,096, 1,536 columns) and DeepSeek-V3's (32 of its 256 experts)."""
    rows = []
    shapes = {"": {}, " V2-Lite": dict(inter=1408, num_experts=64, top_k=6),
              " 235B": dict(hidden=4096, inter=1536), " V3": dict(hidden=7168, inter=2048, num_experts=32)}  # fmt: skip
    for n, shape in [(1, ""), (2, ""), (4, ""), (1, " V2-Lite"), (2, " V2-Lite"), (1, " 235B"), (1, " V3")]:
        label, experts = f"moe T={n}{shape}", shapes[shape]
        fns, refs, nbytes, flops = prepare(functools.partial(moe_case, n, **experts))
        max_tokens = moe.GEMV_MAX_TOKENS
        for name, cfg in [("default", None), ("tiles", None), *((gemv_label(c), c) for c in MOE_GEMV_CANDIDATES_BF16)]:
            calls = [functools.partial(f, gemv=cfg) for f in fns]
            moe.GEMV_MAX_TOKENS = 0 if name == "tiles" else max_tokens
            try:
                rows.append(_timed(label, name, lambda c=calls, b=nbytes, f=flops: (c, {}, b, f)))
            finally:
                moe.GEMV_MAX_TOKENS = max_tokens
        if refs.get(""):
            rows.append(_timed(label, "vllm", lambda r=refs[""], b=nbytes, f=flops: (r, {}, b, f)))
        del fns, refs
    return [r for r in rows if r]


def prefill_sweep() -> list[dict]:
    """Prefill kernel variants: tile configs, register caps, and the chunk's own K/V read packed through
    tensor descriptors instead of gathered from the cache (``packed``)."""
    cfgs = _cfgs(
        "block_m block_n num_warps num_stages maxnreg",
        [
            (128, 64, 8, 2, 128),
            (128, 64, 8, 3, 128),
            (128, 128, 8, 2, None),
            (128, 128, 8, 3, None),
            (64, 64, 4, 3, None),
            (64, 32, 4, 3, 168),
            (64, 64, 4, 2, 168),
            (256, 64, 8, 3, None),
        ],
    )

    def builder(cfg, packed, q_len, ctx):
        q, k_cache, v_cache, cu, lens, tables = inputs = attention_inputs([q_len], [ctx])
        kv = new_kv(k_cache, v_cache, tables, [q_len], [ctx]) if packed else {}
        out, expect, scale = torch.empty_like(q), tk.paged_attention(*inputs, 128**-0.5), 128**-0.5 * 1.4426950408889634
        launch = functools.partial(prefill_attention.prefill_attention, q, out, k_cache, v_cache, cu, lens, tables)
        return lambda: (launch(scale, cfg, **kv), out, expect), None, *attention_cost(q, k_cache, [q_len], [ctx])

    def check(fns) -> dict:  # the first copy's kernel and how far its output is from paged_attention's
        kernel, out, expect = fns[0]()
        diff = (out.float() - expect.float()).abs().max().item()
        return dict(regs=kernel.n_regs, spills=kernel.n_spills, smem=kernel.metadata.shared, diff=diff)

    rows = []
    for q_len, ctx in [(2048, 0), (8192, 0), (512, 4096), (2048, 4096), (4096, 0), (1024, 1024)]:
        for cfg, packed in itertools.product(cfgs, (False, True)):
            case = functools.partial(builder, cfg, packed, q_len, ctx)
            config = {**cfg, "packed": packed}
            rows.append(_timed(f"prefill q={q_len} ctx={ctx}", config, functools.partial(prepare, case), check))
    return [r for r in rows if r]


def _is_default(config) -> bool:
    return config == "default" or (isinstance(config, dict) and config.get("default", False))


def _diff_from(exact: torch.Tensor, fns: list[Callable]) -> dict:
    return dict(diff=max_diff(fns[0](), exact))


# MLA decode tile configs: the defaults are (64, 64, halves, 8, 2) from 64 heads and 8 rows on Hopper,
# (16, 32, -, 4, 3) otherwise (the 2026-11-26 session-9 sweep, docs/performance.md).
# tests/gpu/mla_compile_check.py prints their registers and spills: with Triton 3.9 for sm_90 the
# 16-head default spills 48 bytes over an fp8 cache, and the pipeliner gives the latent tile one buffer
# below 5 stages (the load behind the block-table load takes two of them), two from 5. 64 heads per
# program (two warpgroups, wgmma) over a bf16 cache: (64, 16, halves, 8, 2/3) take 249/251 registers and
# do not spill, two latent tiles in flight; 32 rows spill 8-40 bytes outside the loop, 64 rows inside it;
# the 512 columns as one tile spill more; over an fp8 cache every 64-head config spills inside the loop.
MLA_CONFIGS = _cfgs(
    "BLOCK_H BLOCK_N HALVES num_warps num_stages",
    [
        (16, 32, False, 4, 3),
        (16, 16, False, 4, 3),
        (16, 16, False, 4, 5),
        (16, 32, False, 4, 5),
        (16, 32, False, 8, 3),
        (16, 32, False, 8, 5),
        (32, 32, False, 8, 3),
        (32, 32, False, 8, 5),
        (64, 16, False, 8, 3),
        (64, 16, True, 8, 2),
        (64, 16, True, 8, 3),
        (64, 32, True, 8, 2),
        (64, 32, True, 8, 3),
        (64, 64, True, 8, 2),
    ],
)


def mla_sweep() -> list[dict]:
    """MLA decode tile configs (``BLOCK_H`` heads per program share each tile of ``BLOCK_N`` latent rows it
    loads; 64 heads let Hopper's wgmma run, 16 cannot), each patched in as ``_decode_config``, at
    kernel_bench's MLA shapes; ``diff``: max abs difference from the float32 reference."""
    cfgs = MLA_CONFIGS
    rows, default = [], mla._decode_config
    shapes = [(128, False, 1, 8192), (128, False, 8, 4096), (128, False, 32, 4096), (128, False, 128, 4096)]
    shapes += [(64, False, 32, 4096), (32, False, 32, 4096)]  # V3 at -tp 2 and 4
    shapes += [(128, True, 32, 4096), (16, False, 8, 8192), (16, False, 128, 4096)]
    for heads, fp8, b, ctx in shapes:
        prepared = prepare(functools.partial(mla_case, b, ctx, heads, fp8))
        check = functools.partial(_diff_from, prepared[1][EXACT][0]())
        case = f"mla h={heads}{' fp8' if fp8 else ''} b={b} ctx={ctx}"
        try:
            # None: the default; head blocks at most half padding
            for cfg in [None, *(c for c in cfgs if c["BLOCK_H"] <= 2 * heads)]:
                mla._decode_config = default if cfg is None else (lambda *_, c=cfg: c)
                rows.append(_timed(case, cfg or "default", lambda p=prepared: p, check))
        finally:
            mla._decode_config = default
        del prepared, check
    return [r for r in rows if r]


MLA_PREFILL_CONFIGS = _cfgs(
    "BLOCK_M BLOCK_N num_warps num_stages",
    [(64, 64, 8, 2), (128, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2), (64, 64, 4, 3), (128, 64, 8, 3), (64, 64, 8, 3)],
)  # no spills in Triton 3.6's compile for sm_90 at DeepSeek's dims (Hopper's default: 128, 64, 8, 3)


def mla_prefill_sweep() -> list[dict]:
    """MLA prompt-attention tile configs (``mla_prefill._prefill_config`` patched), bf16, nope 128 / rope 64 /
    v 128: V2-Lite's 16 heads and V3's 128 over 8 whole prompts of 1024 tokens, and a 2048-token chunk after
    6144 earlier rows; ``diff``: max abs difference from the float32 reference."""
    rows, default = [], mla_prefill._prefill_config
    for heads, (q_lens, k_lens) in itertools.product([16, 128], [([1024] * 8, [1024] * 8), ([2048], [8192])]):

        def builder(heads=heads, q_lens=q_lens, k_lens=k_lens):
            cu, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device="cuda")
                        for n in (q_lens, k_lens))  # fmt: skip
            q = torch.randn(sum(q_lens), heads, 192, dtype=torch.bfloat16, device="cuda")
            kv = torch.randn(sum(k_lens), heads, 256, dtype=torch.bfloat16, device="cuda")
            k_pe = torch.randn(sum(k_lens), 576, dtype=torch.bfloat16, device="cuda")[:, 512:]
            args = (q, kv, k_pe, cu, cu_k, max(q_lens), 192**-0.5, 128)
            exact = functools.partial(mla_reference.mla_prefill_attention, q.float(), kv.float(), k_pe.float(),
                                      *args[3:])  # fmt: skip
            pairs = sum(n * (k - n) + n * (n + 1) // 2 for n, k in zip(q_lens, k_lens))  # causal (query, key)
            nbytes = q.nbytes + kv.nbytes + k_pe.nbytes + q.nbytes * 2 // 3
            return functools.partial(tk.mla_prefill_attention, *args), {EXACT: exact}, nbytes, 2 * heads * pairs * 320

        prepared = prepare(builder)
        check = functools.partial(_diff_from, prepared[1][EXACT][0]())
        case = f"mla_prefill h={heads} q={q_lens[0]}x{len(q_lens)} k={k_lens[0]}"
        try:
            for cfg in [None, *MLA_PREFILL_CONFIGS]:
                mla_prefill._prefill_config = default if cfg is None else (lambda *_, c=cfg: c)
                rows.append(_timed(case, cfg or "default", lambda p=prepared: p, check))
        finally:
            mla_prefill._prefill_config = default
        del prepared, check
    return [r for r in rows if r]


def decode_sweep() -> list[dict]:
    """Split-K factors of the decode attention (kernel + merge) at Qwen3-8B's heads (32 / 8), and the decode
    tile's keys a step (``attention._config`` patched) at those and Qwen3-30B-A3B's (32 / 4). The decode CUDA
    graphs are captured with max_seqlen_k = max_model_len, so at batch 1 the heuristic's 64 splits run at
    every context; short contexts are where another factor could win."""
    from atom.ops.triton import attention

    rows, default_config = [], attention._config
    for kv_heads, b, ctx in itertools.product([8, 4], [1, 8], [128, 384, 1024, 4096, 16384]):
        case = f"decode b={b} ctx={ctx}" + ("" if kv_heads == 8 else f" kv={kv_heads}")
        variants = [(s, None) for s in ([None, 1, 2, 4, 8, 16, 32, 64] if kv_heads == 8 else [None])]
        variants += [(None, n) for n in (64, 128)]
        for splits, block_n in variants:  # splits None: the heuristic at max_seqlen_k 32768

            def builder(splits=splits, b=b, ctx=ctx, kv_heads=kv_heads):
                q, k_cache, *_ = inputs = attention_inputs([1] * b, [ctx - 1] * b, num_kv_heads=kv_heads)
                attend = functools.partial(tk.paged_attention, *inputs, 128**-0.5, 1, 32768, num_decode_tokens=b)
                fn = functools.partial(attend, num_splits=splits)
                return fn, None, *attention_cost(q, k_cache, [1] * b, [ctx - 1] * b)

            label = f"block_n={block_n}" if block_n else f"splits={splits}" if splits else "default"
            try:
                if block_n:
                    attention._config = lambda *a, n=block_n, d=default_config: {**d(*a), "block_n": n}
                rows.append(_timed(case, label, functools.partial(prepare, builder)))
            finally:
                attention._config = default_config
    return [r for r in rows if r]


def decode_varlen_sweep() -> list[dict]:
    """Decode batches of uneven contexts, as the throughput workload's steps (128-256 sequences, 100-2,000
    keys each): atom's default split, even splits (``num_splits``), balance splits (``BALANCE_SPLITS`` of at
    least ``SPLIT_MIN_KEYS`` keys, patched in), decode tiles (``attention._config`` patched: keys a step,
    warps, stages), and vLLM's FlashAttention 3 (config ``vllm``) on the same
    cache; max_seqlen_k 4,096 as the decode graphs' (max_model_len). Qwen3-30B-A3B's heads (32 / 4) and
    Qwen3-8B's (32 / 8)."""
    from atom.ops.triton import attention

    variants = [("default", None, None, None), ("splits=1", 1, None, None), ("splits=4", 4, None, None)]
    variants += [(f"balance={b} min={k}", None, (b, k), None) for b, k in [(4, 512), (4, 256), (8, 256)]]
    # the decode tile (default 4 warps, 2 stages, 128 keys a step at 8+ query heads a KV head, else 64), with the
    # default split
    tiles = [(32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 2, 2), (64, 8, 2), (128, 4, 2), (128, 8, 2)]
    tiles += [(128, 8, 3)]
    variants += [(f"block_n={n} w{w} s{st}", None, None, dict(block_n=n, num_warps=w, num_stages=st))
                 for n, w, st in tiles]  # fmt: skip
    rows, default_config = [], attention._config
    for kv_heads, b in itertools.product([4, 8], [128, 256]):
        gen = torch.Generator().manual_seed(b + kv_heads)
        ctx = torch.randint(100, 2000, (b,), generator=gen).tolist()  # cached keys before each decode row
        case = f"decode varlen b={b} kv={kv_heads}"
        builder = functools.partial(attention_case, [1] * b, ctx, num_decode_tokens=b, num_kv_heads=kv_heads,
                                    max_seqlen_k=4096)  # fmt: skip
        prepared = prepare(builder)
        if refs := prepared[1].get(""):
            rows.append(_timed(case, "vllm", lambda p=prepared, r=refs: (r, {}, *p[2:])))
        for label, splits, balance, tile in variants:
            saved = attention.BALANCE_SPLITS, attention.SPLIT_MIN_KEYS
            try:
                if balance:
                    attention.BALANCE_SPLITS, attention.SPLIT_MIN_KEYS = balance
                if tile:
                    attention._config = lambda *a, t=tile, d=default_config: {**d(*a), **t}
                split_builder = functools.partial(builder, num_splits=splits)
                rows.append(_timed(case, label, functools.partial(prepare, split_builder)))
            finally:
                attention.BALANCE_SPLITS, attention.SPLIT_MIN_KEYS = saved
                attention._config = default_config
        del prepared
    return [r for r in rows if r]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # no argparse choices: Python 3.10 rejects an empty list against them
    kernels = "moe, moe_small, moe_fp8, moe_fp8_gemv, moe_gemv, prefill, mla, mla_prefill, decode and/or decode_varlen"
    kernels += " (default: moe, prefill)"
    parser.add_argument("kernels", nargs="*", default=["moe", "prefill"], help=kernels)
    parser.add_argument("--output-json", help="write every row here")
    args = parser.parse_args()
    sweeps = dict(
        moe=moe_sweep,
        moe_small=functools.partial(moe_sweep, small=True),
        moe_fp8=moe_fp8_sweep,
        moe_fp8_gemv=moe_fp8_gemv_sweep,
        moe_gemv=moe_gemv_sweep,
        prefill=prefill_sweep,
        mla=mla_sweep,
        mla_prefill=mla_prefill_sweep,
        decode=decode_sweep,
        decode_varlen=decode_varlen_sweep,
    )
    if unknown := set(args.kernels) - set(sweeps):
        parser.error(f"unknown kernels {sorted(unknown)}: choose from {', '.join(sweeps)}")
    sweep_rows = [r for name in dict.fromkeys(args.kernels) for r in sweeps[name]()]
    print("\nsweep (best 2 per case, and the default):")
    for case in dict.fromkeys(r["case"] for r in sweep_rows):
        rows = sorted((r for r in sweep_rows if r["case"] == case), key=lambda r: r["ms"])
        for r in rows[:2] + [r for r in rows[2:] if _is_default(r["config"]) or r["config"] in ("vllm", "tiles")]:
            print(f"  {case:<22} {r['ms']:8.4f} ms {r['gbps']:6.0f} GB/s {r['tflops']:6.1f} TF  {r['config']}")
    if args.output_json:
        write_to_json(args.output_json, dict(device=torch.cuda.get_device_name(), sweep=sweep_rows), indent=2)


if __name__ == "__main__":
    main()
