"""The MoE at one or two tokens on CUDA-core GEMVs, for bf16 / fp16 or block-scaled FP8 experts.

At a token or two the tile kernels (``moe``, ``moe_fp8``) run a sort by expert, pad each
(token, expert) pair to a 16-row MMA tile and, for FP8, quantise before each GEMM: six launches a
layer. Here three: a gated GEMV with one program per pair and ``block_n`` gate rows with their up
rows (``silu(gate) * up`` rounded where the tile kernel rounds; the pair's expert id read by the
program, no sort), a down GEMV per pair times its routing weight, then ``moe.moe_sum``. The rows
stream as in ``fp8_gemv`` (the token quantised in the kernel for FP8 weights). H200, session 34:
Qwen3-30B-A3B-FP8's experts at one token 25.3 us against the tiles' 40.5 and vLLM's 29.3
(``fp8_configs.moe_gemv_config``; docs/fp8.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from atom.ops.triton.activation import silu_mul
from atom.ops.triton.fp8_gemv import Fp8GemvConfig, _check, _gemv_rows


@dataclass(frozen=True, slots=True)
class MoeGemvConfig:
    """The gated GEMV's launch (``block_n`` gate rows and their up rows a program) and the down
    GEMV's (``half`` applies to FP8 weights only)."""

    gated: Fp8GemvConfig
    down: Fp8GemvConfig


@triton.jit
def _moe_gemv_gated_kernel(
    x_ptr, ids_ptr, w_ptr, ws_ptr, out_ptr, N, K,
    stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_om,
    TOP_K: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr, HALF: tl.constexpr, SCALED: tl.constexpr,
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
        SCALED,
    )  # fmt: skip
    gate, up = tl.split(tl.reshape(out, [BLOCK_N, 2]))
    dtype = out_ptr.dtype.element_ty
    h = silu_mul(gate, up, dtype)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + cols, h.to(dtype), mask=cols < N)


@triton.jit
def _moe_gemv_down_kernel(
    x_ptr, ids_ptr, weights_ptr, w_ptr, ws_ptr, out_ptr, N, K,
    stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_om,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr, HALF: tl.constexpr,
    SCALED: tl.constexpr,
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
        SCALED,
    )  # fmt: skip
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair).to(dtype).to(tl.float32)
    tl.store(out_ptr + pair * stride_om + rn, (y.to(dtype).to(tl.float32) * weight).to(dtype), mask=rn < N)


def moe_gemv_pairs(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    cfg: MoeGemvConfig, scales: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Each (token, expert) pair's weighted expert output [T, k, H], whose sum over k (``moe.moe_sum``)
    is ``reference.fused_moe`` (16-bit experts [E, 2I, H] / [E, H, I] in ``x``'s dtype) or, with
    ``scales`` = (w13_scale, w2_scale, group_k), ``reference_fp8.fused_moe_fp8`` (e4m3 experts with
    block scales [E, N, K / group_k], any strides); for a few tokens, rows contiguous along K."""
    s13, s2, group_k = scales if scales is not None else (None, None, 0)
    if scales is not None:
        _check(group_k, cfg.gated)
        _check(group_k, cfg.down)
    elif w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"the MoE GEMV needs {x.dtype} experts or FP8 ones with scales, got {w13.dtype}")
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("the MoE GEMV needs rows contiguous along K")
    ids = topk_ids.contiguous().view(-1)
    inter = gated_gemv(x, w13, ids, topk_ids.shape[1], cfg.gated, s13, group_k)
    out = down_gemv(inter, w2, topk_weights.contiguous().view(-1), ids, cfg.down, s2, group_k)
    return out.view(*topk_ids.shape, -1)


def _scale_args(scale: torch.Tensor | None, w: torch.Tensor) -> tuple:
    # no scales: the weight stands in for the unread pointer
    return (w, 0, 0, 0) if scale is None else (scale, *scale.stride())


def gated_gemv(
    x: torch.Tensor, w13: torch.Tensor, ids: torch.Tensor, top_k: int, cfg: Fp8GemvConfig,
    scale: torch.Tensor | None = None, group_k: int = 0,
) -> torch.Tensor:  # fmt: skip
    """``silu(gate) * up`` [pairs, I] of each pair ``p``'s token ``x[p // top_k]`` through expert
    ``ids[p]``'s rows of ``w13`` [E, 2I, H] (gate then up; e4m3 with ``scale`` in ``group_k`` groups)."""
    inter_size, hidden = w13.shape[1] // 2, x.shape[1]
    inter = torch.empty(ids.numel(), inter_size, dtype=x.dtype, device=x.device)
    s, *s_strides = _scale_args(scale, w13)
    _moe_gemv_gated_kernel[(triton.cdiv(inter_size, cfg.block_n), ids.numel())](
        x, ids, w13, s, inter, inter_size, hidden, x.stride(0), w13.stride(0), w13.stride(1), *s_strides,
        inter.stride(0),
        TOP_K=top_k, EVEN_K=hidden % cfg.block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_K=group_k or cfg.block_k, HALF=cfg.half, SCALED=scale is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return inter


def down_gemv(
    inter: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, cfg: Fp8GemvConfig,
    scale: torch.Tensor | None = None, group_k: int = 0,
) -> torch.Tensor:  # fmt: skip
    """``weights[p] * inter[p] @ w2[ids[p]].T`` [pairs, H] (``w2`` [E, H, I]; e4m3 with ``scale``)."""
    hidden, inter_size = w2.shape[1], inter.shape[1]
    out = torch.empty(ids.numel(), hidden, dtype=inter.dtype, device=inter.device)
    s, *s_strides = _scale_args(scale, w2)
    _moe_gemv_down_kernel[(triton.cdiv(hidden, cfg.block_n), ids.numel())](
        inter, ids, weights, w2, s, out, hidden, inter_size, inter.stride(0), w2.stride(0), w2.stride(1),
        *s_strides, out.stride(0),
        EVEN_K=inter_size % cfg.block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_K=group_k or cfg.block_k, HALF=cfg.half, SCALED=scale is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
