"""Fused MoE with FP8 (e4m3) expert weights: ``atom.ops.triton.moe``'s recipe (pairs sorted
by expert into ``BLOCK_M`` row tiles, gate/up GEMM with ``silu_and_mul`` fused, down GEMM
times the routing weight) with the GEMM inputs quantised per token (group) first and the
scales of ``atom.ops.reference_fp8`` applied per key group (block weights) or at the end
(per-channel weights). Tiles: ``atom.ops.triton.fp8_configs``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.ops.triton.fp8_configs import moe_config, moe_gemv_config
from atom.ops.triton.fp8_gemm import per_token_group_quant_fp8
from atom.ops.triton.moe import _paired_rows, _row_tile, _sort_by_expert, _store_tile, _tile_ids, moe_sum
from atom.ops.triton.moe_gemv import MoeGemvConfig, moe_gemv_pairs


# vary by batch (as in moe.py): the pairs, and the column-major activation scales' group
# stride (= tokens; a variant compiled for odd counts was a warm-up gap of Qwen3-30B-A3B-FP8)
@triton.jit(do_not_specialize=["num_pairs", "stride_ask", "num_m"])
def _moe_fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    N, K, num_pairs, num_m, stride_am, stride_asm, stride_ask, stride_be, stride_bn, stride_bse, stride_bsn,
    stride_bsk, stride_cm,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, PER_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PAIRED: tl.constexpr,
):  # fmt: skip
    """``c[pair] = dequant(a[pair // A_ROW_DIV]) @ dequant(b[expert]).T`` for one row tile;
    GATED: gate rows then up rows (N each), c = silu(gate) * up; MUL_WEIGHT: times the pair's
    routing weight. ``num_m``, ``GROUP_M``: the tiles' order (``moe._tile_ids``). PAIRED (with GATED):
    one dot a key step over the gate and up rows interleaved (2 x BLOCK_N columns), split apart at the
    end, instead of a dot each: one wgmma twice as wide reads the ``a`` tile from shared memory once.
    Block scales are read one key step ahead (carried across the loop), as in ``fp8_gemm``: read in
    their own step (vLLM's order, 110 instead of 140 registers at the paired 16 x 64 tile) was 0.6-1.2%
    faster at 16-row tiles (equal with their row groups of 16) and 17% slower at 64-row ones (H200, session 31).
    Quantising the 16-bit rows here a key step at a time (no quantisation launches; session 34) was 2.0-7.6x
    slower at 1-2,048 tokens (H200, session 35): each of a GEMM's 12-16 column tiles quantised its rows again."""
    pid_m, pid_n = _tile_ids(num_m, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs, row_ok, a_rows, expert, offs_n, n_ok, offs_k, a_ptrs, b_ptrs = _row_tile(
        a_ptr, b_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs, N, stride_am, stride_be, stride_bn, pid_m, pid_n,
        A_ROW_DIV, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    as_ptrs = as_ptr + a_rows * stride_asm
    bs_ptrs = bs_ptr + expert * stride_bse + offs_n * stride_bsn
    up_off = N * stride_bsn
    TWO_DOTS: tl.constexpr = GATED and not PAIRED
    b_ok = n_ok
    if GATED and PAIRED:
        b_rows, b_ok, b_ptrs = _paired_rows(b_ptr, expert, stride_be, stride_bn, offs_k, pid_n, N, BLOCK_N)
        bs_ptrs = bs_ptr + expert * stride_bse + b_rows * stride_bsn
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N if PAIRED and GATED else BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    steps = tl.cdiv(K, BLOCK_K)
    if PER_GROUP:
        a_s = tl.load(as_ptrs, mask=row_ok, other=0.0)[:, None]
        b_s = tl.load(bs_ptrs, mask=b_ok, other=0.0)[None, :]
        up_s = b_s
        if TWO_DOTS:
            up_s = tl.load(bs_ptrs + up_off, mask=n_ok, other=0.0)[None, :]
    for kt in range(steps):
        k_ok = offs_k < K - kt * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & b_ok[None, :], other=0.0)
        if TWO_DOTS:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if PER_GROUP:
            # the next step's scales, loaded while this step's MMAs run (the index clamped into range:
            # the value read after the last step is unused)
            sk = tl.minimum(kt + 1, steps - 1)
            a_s_k = tl.load(as_ptrs + sk * stride_ask, mask=row_ok, other=0.0)[:, None]
            b_s_k = tl.load(bs_ptrs + sk * stride_bsk, mask=b_ok, other=0.0)[None, :]
            up_s_k = b_s_k
            if TWO_DOTS:
                up_s_k = tl.load(bs_ptrs + up_off + sk * stride_bsk, mask=n_ok, other=0.0)[None, :]
            acc += tl.dot(a, b) * a_s * b_s
            if TWO_DOTS:
                acc_up += tl.dot(a, b_up) * a_s * up_s
            a_s, b_s, up_s = a_s_k, b_s_k, up_s_k
        else:  # float32 promotion once per step, as in fp8_gemm
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
            if TWO_DOTS:
                acc_up = tl.dot(a, b_up, acc_up, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not PER_GROUP:
        a_s = tl.load(as_ptrs, mask=row_ok, other=0.0)[:, None]
        acc = acc * a_s * tl.load(bs_ptrs, mask=b_ok, other=0.0)[None, :]
        if TWO_DOTS:
            acc_up = acc_up * a_s * tl.load(bs_ptrs + up_off, mask=n_ok, other=0.0)[None, :]
    if GATED and PAIRED:
        acc, acc_up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    _store_tile(c_ptr, stride_cm, weights_ptr, acc, acc_up, pairs, row_ok, offs_n, n_ok, GATED, MUL_WEIGHT)


def _gemm(a, a_scale, b, b_scale, c, weights, sorted_ids, expert_ids, num_padded, n, a_row_div, gated, group_k,
          cfg):  # fmt: skip
    grid = (expert_ids.shape[0] * triton.cdiv(n, cfg["BLOCK_N"]),)
    _moe_fp8_gemm_kernel[grid](
        a, a_scale, b, b_scale, c, weights, sorted_ids, expert_ids, num_padded, n, b.shape[2], c.shape[0],
        expert_ids.shape[0], a.stride(0), a_scale.stride(0), a_scale.stride(1), b.stride(0), b.stride(1),
        b_scale.stride(0), b_scale.stride(1), b_scale.stride(2), c.stride(0),
        A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=not gated, PER_GROUP=group_k > 0,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=group_k or cfg.get("BLOCK_K", 128),
        GROUP_M=cfg.get("GROUP_M", 0), PAIRED=cfg.get("paired", False),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


def fused_moe_fp8(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, group_k: int, config: dict | MoeGemvConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """``config`` overrides the tile table (the sweep's candidates), for both GEMMs; its
    ``down`` entry, if any, overrides keys for the down GEMM (same BLOCK_M). A few tokens
    (``fp8_configs.moe_gemv_config``), or a ``MoeGemvConfig``, take the CUDA-core GEMVs instead."""
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    gemv = config if isinstance(config, MoeGemvConfig) else None
    if config is None:
        gemv = moe_gemv_config(num_tokens, hidden, w2.shape[2], group_k)
    if gemv is not None:
        return moe_sum(moe_gemv_pairs(x, w13, w2, topk_weights, topk_ids, gemv, (w13_scale, w2_scale, group_k)))
    num_experts, two_i, _ = w13.shape
    inter_size = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    cfg = config or moe_config(num_pairs / num_experts, group_k > 0)
    down = {**cfg, **cfg.get("down", {})}
    weights = topk_weights.contiguous().view(-1)
    sorted_ids, expert_ids, num_padded = _sort_by_expert(topk_ids, num_experts, cfg["BLOCK_M"])
    a, a_scale = per_token_group_quant_fp8(x.contiguous(), group_k)
    inter = torch.empty(num_pairs, inter_size, dtype=x.dtype, device=x.device)
    _gemm(a, a_scale, w13, w13_scale, inter, weights, sorted_ids, expert_ids, num_padded, inter_size, top_k, True,
          group_k, cfg)  # fmt: skip
    a, a_scale = per_token_group_quant_fp8(inter, group_k)
    out_pairs = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _gemm(a, a_scale, w2, w2_scale, out_pairs, weights, sorted_ids, expert_ids, num_padded, hidden, 1, False,
          group_k, down)  # fmt: skip
    return moe_sum(out_pairs.view(num_tokens, top_k, hidden))
