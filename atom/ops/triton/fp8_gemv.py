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
is ``reference_fp8.fp8_linear``'s up to summation order, with no quantisation launch (or, where the
RMS norm before wrote the row's codes and scales, reads those: the same bits, no quantising). On an H200
it beats the skinny kernel on small layers only (Qwen3-8B's qkv and o: 13.6 / 11.2 us against
15.3 / 12.8), not on gate_up and down, whose 128-row skinny programs with key splits keep more
loads in flight; ``fp8_configs.gemv_config`` picks it by size (docs/fp8.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True, slots=True)
class Fp8GemvConfig:
    block_n: int  # weight rows a program
    block_k: int  # keys a step: a multiple of the scale group
    num_warps: int = 4
    num_stages: int = 2
    half: bool = True  # runs of 16 products summed in float16 (else every product in float32)


@triton.jit
def _gemv_rows(x_row, w_rows, ws_rows, stride_wsk, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_K: tl.constexpr, HALF: tl.constexpr, SCALED: tl.constexpr = True, xs_row=None,
               stride_xsk=0, CODES: tl.constexpr = False):  # fmt: skip
    """float32 dot products of the 16-bit row at ``x_row`` (quantised here, as
    ``per_token_group_quant_fp8`` does) with the e4m3 weight rows ``w_rows`` ([rows, 1, 1, 1]
    pointers) whose scales start at ``ws_rows`` ([rows, 1] pointers), each scale group's partial
    sum times its scales. CODES: ``x_row`` is that quantisation already made (e4m3 codes, their
    group scales at ``xs_row``, ``stride_xsk`` apart), read instead. Not SCALED: 16-bit weight rows
    times the row as it is, in float32 (``GROUP_K`` only shapes the step; ``ws_rows`` unread)."""
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
        g = k0 // GROUP_K + rg
        if EVEN_K:
            x = tl.load(x_row + k)
            w = tl.load(w_rows + k[None], eviction_policy="evict_first")
        else:
            x = tl.load(x_row + k, mask=k < K, other=0.0)
            w = tl.load(w_rows + k[None], mask=k[None] < K, other=0.0, eviction_policy="evict_first")
        if CODES:
            xq = x
            xs = tl.load(xs_row + g * stride_xsk, mask=g < num_groups, other=0.0)
        elif SCALED:
            # the row's groups quantised as per_token_group_quant_fp8 does: amax / 448 times the float32
            # reciprocal, an IEEE-rounded division, e4m3 codes; zeros past K leave amax unchanged
            x = x.to(tl.float32)
            xs = tl.maximum(tl.max(tl.max(tl.abs(x), axis=2), axis=1) * (1.0 / 448.0), 1e-12)
            xq = tl.clamp(tl.math.div_rn(x, xs[:, None, None]), -448.0, 448.0).to(w.dtype)
        if SCALED:
            if HALF:
                prod = w.to(tl.float16) * (xq.to(tl.float16) * 0.00390625)[None]
                part = tl.sum(tl.sum(prod, axis=3).to(tl.float32), axis=2) * 256.0
            else:
                part = tl.sum(tl.sum(w.to(tl.float32) * xq.to(tl.float32)[None], axis=3), axis=2)
            ws = tl.load(ws_rows + g[None, :] * stride_wsk, mask=g[None, :] < num_groups, other=0.0)
            acc += part * (ws * xs[None, :])
        else:
            acc += tl.sum(tl.sum(w.to(tl.float32) * x.to(tl.float32)[None], axis=3), axis=2)
    return tl.sum(acc, axis=1)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, N, K,
    stride_xm, stride_xsm, stride_xsk, stride_wn, stride_wsn, stride_wsk, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr, HALF: tl.constexpr, CODES: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_load = tl.minimum(rn, N - 1)  # out-of-range rows read a valid row, never stored
    out = _gemv_rows(
        x_ptr + row.to(tl.int64) * stride_xm, w_ptr + rn_load.to(tl.int64)[:, None, None, None] * stride_wn,
        ws_ptr + rn_load[:, None] * stride_wsn, stride_wsk, K, EVEN_K, BLOCK_K, GROUP_K, HALF, True,
        xs_ptr + row.to(tl.int64) * stride_xsm, stride_xsk, CODES,
    )  # fmt: skip
    if HAS_BIAS:
        out += tl.load(b_ptr + rn_load).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_om + rn, out.to(out_ptr.dtype.element_ty), mask=rn < N)


def fp8_gemv(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_k: int, cfg: Fp8GemvConfig,
    bias: torch.Tensor | None = None, x_codes: torch.Tensor | None = None, x_scales: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``reference_fp8.fp8_linear(x, w, w_scale, group_k, bias, x_codes=..., x_scales=...)`` for a few
    16-bit rows ``x`` [M, K] (one program row per input row: meant for M = 1), e4m3 ``w`` [N, K] with
    float32 scales ``w_scale`` [N, cdiv(K, group_k)] (any strides), in ``x``'s dtype. Given
    ``x_codes`` [M, K] and ``x_scales`` [M, cdiv(K, group_k)] (``x``'s quantisation, any strides),
    it reads those and not ``x``."""
    m, k = x.shape
    n = w.shape[0]
    _check(group_k, cfg)
    a = x if x_codes is None else x_codes
    if a.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("the FP8 GEMV needs rows contiguous along K")
    a_scale = x_scales if x_codes is not None else w_scale  # unread without codes
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n), m)](
        a, a_scale, w, w_scale, bias if bias is not None else out, out, n, k,
        a.stride(0), a_scale.stride(0), a_scale.stride(1), w.stride(0), w_scale.stride(0), w_scale.stride(1),
        out.stride(0), HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_K=group_k, HALF=cfg.half, CODES=x_codes is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def _check(group_k: int, cfg: Fp8GemvConfig) -> None:
    if group_k < 16 or group_k & (group_k - 1) or cfg.block_k % group_k or cfg.block_k & (cfg.block_k - 1):
        raise ValueError(f"the FP8 GEMV needs a power-of-two scale group (>= 16) dividing a power-of-two block_k; "
                         f"got group {group_k}, block_k {cfg.block_k}")  # fmt: skip
