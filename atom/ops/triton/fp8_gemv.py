"""FP8 GEMV on CUDA cores: a block-scaled FP8 linear layer for one input row (batch-1 decode).

At one row a linear layer only streams its weight. The skinny kernel (``gemv.skinny_gemm``,
``dot_t``) runs it on the tensor cores with the row padded to 16 and one 128-column scale
group a key step, and on an H200 streams Qwen3-8B-FP8's layer at ~55% of the copy bandwidth
(``tests/gpu/decode_chain.py``), where the bf16 one-row kernel, on CUDA cores with 1,024-2,048
keys a step, reaches ~86%. This kernel is that launch for e4m3 weights: each program owns
``block_n`` weight rows and walks the whole key range (no split, no second kernel) in steps of
``block_k`` keys, several scale groups at once: per group a partial sum, times the group's
weight and activation scales. The activation is quantised here, each program quantising the
row as it reads it (the same codes and scales as ``per_token_group_quant_fp8``), so the product
is ``reference_fp8.fp8_linear``'s up to summation order, with no quantisation launch. On an H200
it beats the skinny kernel on small layers only (Qwen3-8B's qkv and o: 13.6 / 11.2 us against
15.3 / 12.8), not on gate_up and down, whose 128-row skinny programs with key splits keep more
loads in flight; ``fp8_configs.gemv_config`` picks it by size (docs/fp8.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from atom.ops.triton.moe import moe_sum


@dataclass(frozen=True, slots=True)
class Fp8GemvConfig:
    block_n: int  # weight rows a program
    block_k: int  # keys a step: a multiple of the scale group
    num_warps: int = 4
    num_stages: int = 2
    half: bool = True  # runs of 16 products summed in float16 (else every product in float32)


@triton.jit
def _gemv_rows(x_row, w_rows, ws_rows, stride_wsk, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_K: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """float32 dot products of the 16-bit row at ``x_row`` (quantised here, as
    ``per_token_group_quant_fp8`` does) with the e4m3 weight rows ``w_rows`` ([rows, 1, 1, 1]
    pointers) whose scales start at ``ws_rows`` ([rows, 1] pointers), each scale group's partial
    sum times its scales."""
    # a step's keys as [GROUPS, RUNS, 16]: scale groups of runs of 16 keys. HALF: each run's 16
    # products summed in float16 (e4m3 -> f16 is one conversion per two weights, f16 -> f32 one per
    # run; the activation codes times 2^-8 so that no product or run sum overflows f16), the runs in
    # float32; else every product in float32
    GROUPS: tl.constexpr = BLOCK_K // GROUP_K
    RUNS: tl.constexpr = GROUP_K // 16
    rg = tl.arange(0, GROUPS)
    keys = rg[:, None, None] * GROUP_K + tl.arange(0, RUNS)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    num_groups = tl.cdiv(K, GROUP_K)
    acc = tl.zeros((w_rows.shape[0], GROUPS), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + keys
        if EVEN_K:
            x = tl.load(x_row + k).to(tl.float32)
            w = tl.load(w_rows + k[None], eviction_policy="evict_first")
        else:
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            w = tl.load(w_rows + k[None], mask=k[None] < K, other=0.0, eviction_policy="evict_first")
        # the row's groups quantised as per_token_group_quant_fp8 does: amax / 448 times the float32
        # reciprocal, an IEEE-rounded division, e4m3 codes; zeros past K leave amax unchanged
        xs = tl.maximum(tl.max(tl.max(tl.abs(x), axis=2), axis=1) * (1.0 / 448.0), 1e-12)
        xq = tl.clamp(tl.math.div_rn(x, xs[:, None, None]), -448.0, 448.0).to(w.dtype)
        if HALF:
            prod = w.to(tl.float16) * (xq.to(tl.float16) * 0.00390625)[None]
            part = tl.sum(tl.sum(prod, axis=3).to(tl.float32), axis=2) * 256.0
        else:
            part = tl.sum(tl.sum(w.to(tl.float32) * xq.to(tl.float32)[None], axis=3), axis=2)
        g = k0 // GROUP_K + rg
        ws = tl.load(ws_rows + g[None, :] * stride_wsk, mask=g[None, :] < num_groups, other=0.0)
        acc += part * (ws * xs[None, :])
    return tl.sum(acc, axis=1)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, N, K,
    stride_xm, stride_wn, stride_wsn, stride_wsk, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_load = tl.minimum(rn, N - 1)  # out-of-range rows read a valid row, never stored
    out = _gemv_rows(
        x_ptr + row.to(tl.int64) * stride_xm, w_ptr + rn_load.to(tl.int64)[:, None, None, None] * stride_wn,
        ws_ptr + rn_load[:, None] * stride_wsn, stride_wsk, K, EVEN_K, BLOCK_K, GROUP_K, HALF,
    )  # fmt: skip
    if HAS_BIAS:
        out += tl.load(b_ptr + rn_load).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_om + rn, out.to(out_ptr.dtype.element_ty), mask=rn < N)


def fp8_gemv(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_k: int, cfg: Fp8GemvConfig,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``reference_fp8.fp8_linear(x, w, w_scale, group_k, bias)`` for a few 16-bit rows ``x`` [M, K]
    (one program row per input row: meant for M = 1), e4m3 ``w`` [N, K] with float32 scales
    ``w_scale`` [N, cdiv(K, group_k)] (any strides), in ``x``'s dtype."""
    m, k = x.shape
    n = w.shape[0]
    _check(group_k, cfg)
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("the FP8 GEMV needs rows contiguous along K")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n), m)](
        x, w, w_scale, bias if bias is not None else out, out, n, k,
        x.stride(0), w.stride(0), w_scale.stride(0), w_scale.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_K=group_k, HALF=cfg.half, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


@dataclass(frozen=True, slots=True)
class MoeGemvConfig:
    """The FP8 MoE's launches at a few tokens (``fused_moe_fp8_gemv``): the gated GEMV's
    (``block_n`` gate rows and their up rows a program) and the down GEMV's."""

    gated: Fp8GemvConfig
    down: Fp8GemvConfig


@triton.jit
def _moe_gemv_gated_kernel(
    x_ptr, ids_ptr, w_ptr, ws_ptr, out_ptr, N, K,
    stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_om,
    TOP_K: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """``out[pair] = silu(gate) * up`` of ``x[pair // TOP_K]`` through expert ``ids[pair]``'s gate
    rows (``w[e, :N]``) and up rows (``w[e, N:]``), rounded where the tile kernel rounds."""
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    j = tl.arange(0, 2 * BLOCK_N)
    rn = pid_n * BLOCK_N + j // 2
    rows = tl.minimum(rn, N - 1) + (j % 2) * N  # gate row r, then its up row, side by side
    out = _gemv_rows(
        x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm,
        w_ptr + expert * stride_we + rows.to(tl.int64)[:, None, None, None] * stride_wn,
        ws_ptr + expert * stride_wse + rows[:, None] * stride_wsn, stride_wsk, K, EVEN_K, BLOCK_K, GROUP_K, HALF,
    )  # fmt: skip
    gate, up = tl.split(tl.reshape(out, [BLOCK_N, 2]))
    dtype = out_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    h = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + cols, h.to(dtype), mask=cols < N)


@triton.jit
def _moe_gemv_down_kernel(
    x_ptr, ids_ptr, weights_ptr, w_ptr, ws_ptr, out_ptr, N, K,
    stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_om,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """``out[pair] = weights[pair] * x[pair] @ w[ids[pair]].T``, the product and the weighted term
    rounded to the output dtype as the tile kernel rounds them (``moe_sum`` adds a token's pairs).
    One program a pair and row block: summing a token's experts in the program instead, each program
    walking them one after another, was 1.6x slower at one token (H200, session 34)."""
    pid_n = tl.program_id(0)
    pair = tl.program_id(1).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_load = tl.minimum(rn, N - 1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    y = _gemv_rows(
        x_ptr + pair * stride_xm, w_ptr + expert * stride_we + rn_load.to(tl.int64)[:, None, None, None] * stride_wn,
        ws_ptr + expert * stride_wse + rn_load[:, None] * stride_wsn, stride_wsk, K, EVEN_K, BLOCK_K, GROUP_K, HALF,
    )  # fmt: skip
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair).to(dtype).to(tl.float32)
    tl.store(out_ptr + pair * stride_om + rn, (y.to(dtype).to(tl.float32) * weight).to(dtype), mask=rn < N)


def _check(group_k: int, cfg: Fp8GemvConfig) -> None:
    if group_k < 16 or group_k & (group_k - 1) or cfg.block_k % group_k or cfg.block_k & (cfg.block_k - 1):
        raise ValueError(f"the FP8 GEMV needs a power-of-two scale group (>= 16) dividing a power-of-two block_k; "
                         f"got group {group_k}, block_k {cfg.block_k}")  # fmt: skip


def fused_moe_fp8_gemv(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, group_k: int, cfg: MoeGemvConfig,
) -> torch.Tensor:  # fmt: skip
    """``moe_fp8.fused_moe_fp8`` for a few tokens, with no sort and no quantisation launch: each
    (token, expert) pair's gate / up rows stream through the CUDA-core GEMV (the token quantised in
    the kernel), then each pair's down rows, weighted, and ``moe_sum`` over a token's pairs. Expert weights
    [E, N, K] e4m3 with block scales [E, N, K / group_k] (any strides), rows contiguous along K."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter_size, top_k = two_i // 2, topk_ids.shape[1]
    _check(group_k, cfg.gated)
    _check(group_k, cfg.down)
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("the FP8 MoE GEMV needs rows contiguous along K")
    if num_tokens == 0:
        return torch.zeros_like(x)
    ids = topk_ids.contiguous().view(-1)
    weights = topk_weights.contiguous().view(-1)
    num_pairs = ids.numel()
    inter = torch.empty(num_pairs, inter_size, dtype=x.dtype, device=x.device)
    g = cfg.gated
    _moe_gemv_gated_kernel[(triton.cdiv(inter_size, g.block_n), num_pairs)](
        x, ids, w13, w13_scale, inter, inter_size, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), w13_scale.stride(2),
        inter.stride(0),
        TOP_K=top_k, EVEN_K=hidden % g.block_k == 0, BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_K=group_k,
        HALF=g.half, num_warps=g.num_warps, num_stages=g.num_stages,
    )  # fmt: skip
    d = cfg.down
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _moe_gemv_down_kernel[(triton.cdiv(hidden, d.block_n), num_pairs)](
        inter, ids, weights, w2, w2_scale, out, hidden, inter_size,
        inter.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), w2_scale.stride(2),
        out.stride(0),
        EVEN_K=inter_size % d.block_k == 0, BLOCK_N=d.block_n, BLOCK_K=d.block_k, GROUP_K=group_k, HALF=d.half,
        num_warps=d.num_warps, num_stages=d.num_stages,
    )  # fmt: skip
    return moe_sum(out.view(num_tokens, top_k, hidden))
