"""Skinny GEMM: ``F.linear`` for a few rows (batch-1..small-batch decode).

At a handful of rows a linear layer only streams its weight, and cuBLAS reaches 50-80% of
the copy bandwidth on decode shapes. Here each program owns ``block_n`` rows of the weight
(contiguous along K, loaded in wide vectors) for all M input rows and walks K in
``block_k`` steps, accumulating in fp32; when N alone gives too few programs to fill the
GPU, K is split over ``split_k`` programs whose fp32 partial sums a second small kernel
adds in a fixed order (deterministic, no atomics). Four ways to multiply a tile:

- ``sum``: broadcast-multiply and reduce over K every step;
- ``defer``: accumulate the products elementwise and reduce over K once at the end;
- ``dot``: ``tl.dot`` with M padded to 16;
- ``dot_t``: ``tl.dot`` of the weight tile by the transposed input ("swap AB"): the weight's
  ``block_n`` rows fill the MMA's long side (64 rows: Hopper's wgmma) and the few input rows
  pad only its short side to 16.

The same kernel runs FP8 (e4m3) weights and activations with float32 scales
(``atom.ops.reference_fp8.w8a8_matmul``'s product, called from ``fp8_gemm.w8a8_matmul`` for a
few rows): per-channel scales multiply the accumulator once, block scales (one per row and
``group_k`` key columns) each key step's partial product, so a step is one scale group.

``pick_config`` holds the sweeps' winners (``sum`` at 1-2 rows, ``dot`` above); split-K and
``defer`` stay as options for other GPUs and shapes (tests/gpu/gemv_bench.py times a grid).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from atom.ops.triton.activation import silu_and_mul, silu_mul

_MODES = {"sum": 0, "defer": 1, "dot": 2, "dot_t": 3}
# Where the skinny kernel beats cuBLAS (H100 sweep, tests/gpu/gemv_bench.py, CUDA-graph replay
# over weight copies that do not fit L2): at one row on every Qwen3 projection (8B: 80-97% of
# the copy bandwidth vs cuBLAS's 70-90%), and up to 32 rows for vocabulary-wide weights (the
# LM head: 96-100% vs 80%). At 2-32 rows on the other shapes it only matches cuBLAS.
MAX_ROWS = 1
WIDE_MAX_ROWS = 32
WIDE_N = 65536


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int = 1
    mode: str = "sum"
    num_warps: int = 4
    num_stages: int = 2


# M is not specialised (M == 1 would be a variant of its own): one compiled variant per
# power-of-two row bucket, all of which CUDA-graph capture and warm-up compile at start-up.
# Nor are the strides that follow M: the column-major activation scales' (M apart) and the
# split-K partial sums' (M * N apart); Triton would compile variants for 1 and multiples of 16.
@triton.jit(do_not_specialize=["M", "stride_os", "stride_xsk"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, xs_ptr, ws_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om, stride_os, stride_xsm, stride_xsk, stride_wsn, stride_wsk,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, EVEN_K: tl.constexpr, MODE: tl.constexpr,
    SCALES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    QUANT_X: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    # SCALES: 0 none; 1 one scale per input row (xs[m, 0]) and weight row (ws[n, 0]), applied
    # once; 2 one per row and BLOCK_K-wide key group (xs[m, g], ws[n, g]), applied every step.
    # QUANT_X (with SCALES 2): x is 16-bit and each step quantises its group to e4m3 here, as
    # fp8_gemm's _group_quant_kernel does (the same codes and scales; xs_ptr is unused).
    # GATED: the weight is gate rows then up rows (N / 2 each) and the output silu(gate) * up;
    # product row n is weight row n // 2 of the gate half (n even) or of the up half (n odd),
    # so a program's gate rows and their up rows part with one tl.split in the epilogue; split-K
    # partial sums are stored by weight row (gate rows then up rows), so the reduction reads both
    # halves in contiguous runs
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # out-of-range rows read a valid row (their results are never stored): no load masks on M, N
    rm_load = tl.minimum(rm, M - 1)
    if GATED:
        rn_load = tl.minimum(rn // 2, N // 2 - 1) + (rn % 2) * (N // 2)
    else:
        rn_load = tl.minimum(rn, N - 1)
    x_rows = x_ptr + rm_load.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + rn_load.to(tl.int64)[:, None] * stride_wn
    xs_rows = xs_ptr + rm_load * stride_xsm
    ws_rows = ws_ptr + rn_load * stride_wsn
    k_start = pid_k * k_per_split
    if SCALES == 2:
        # block scales are read one key step ahead, so their latency hides behind the step's
        # loads and MMA (as in fp8_gemm's tile kernel); past the last group, the last is reread
        last_group = tl.cdiv(K, BLOCK_K) - 1
        if QUANT_X:
            xs = tl.zeros((BLOCK_M,), dtype=tl.float32)
        else:
            xs = tl.load(xs_rows + (k_start // BLOCK_K) * stride_xsk)
        ws = tl.load(ws_rows + (k_start // BLOCK_K) * stride_wsk)
    # the weight is read once: it streams past L2 (evict_first) and leaves x and the other
    # layers' small tensors there
    if MODE == 1:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    elif MODE == 3:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # transposed until the end
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        k = k_start + k0 + rk
        if EVEN_K:
            x = tl.load(x_rows + k[None, :])
            w = tl.load(w_rows + k[None, :], eviction_policy="evict_first")
        else:
            x = tl.load(x_rows + k[None, :], mask=k[None, :] < K, other=0.0)
            w = tl.load(w_rows + k[None, :], mask=k[None, :] < K, other=0.0, eviction_policy="evict_first")
        if SCALES == 2:
            # this step's partial product times its group's scales
            group_next = tl.minimum((k_start + k0) // BLOCK_K + 1, last_group)
            ws_next = tl.load(ws_rows + group_next * stride_wsk)
            if QUANT_X:
                # amax / 448 times the float32 reciprocal, an IEEE-rounded division (as the
                # quantisation kernel and the reference); zeros past K leave amax unchanged
                xf = x.to(tl.float32)
                xs = tl.maximum(tl.max(tl.abs(xf), axis=1) * (1.0 / 448.0), 1e-12)
                x = tl.clamp(tl.math.div_rn(xf, xs[:, None]), -448.0, 448.0).to(w.dtype)
                xs_next = xs
            else:
                xs_next = tl.load(xs_rows + group_next * stride_xsk)
            if MODE == 3:
                acc += tl.dot(w, tl.trans(x)) * (ws[:, None] * xs[None, :])
            elif MODE == 2:
                acc += tl.dot(x, tl.trans(w)) * (xs[:, None] * ws[None, :])
            else:
                part = tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
                acc += part * (xs[:, None] * ws[None, :])
            xs, ws = xs_next, ws_next
        elif MODE == 3:
            # FP8 (SCALES 1): Hopper's fp8 MMA accumulates in reduced precision; promote to
            # float32 every step (see fp8_gemm's per-channel kernel)
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=BLOCK_K if SCALES == 1 else None)
        elif MODE == 2:
            acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=BLOCK_K if SCALES == 1 else None)
        elif MODE == 1:
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if MODE == 1:
        acc = tl.sum(acc3, axis=2)
    elif MODE == 3:
        acc = tl.trans(acc)
    if SCALES == 1:
        acc = acc * tl.load(xs_rows)[:, None] * tl.load(ws_rows)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    if PARTIAL:  # GATED: by weight row, as loaded; the reduction applies the gate
        if GATED:
            offs = rm.to(tl.int64)[:, None] * stride_om + rn_load[None, :]
        tl.store(out_ptr + pid_k.to(tl.int64) * stride_os + offs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn_load).to(tl.float32)[None, :]
        dtype = out_ptr.dtype.element_ty
        if GATED:
            gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
            cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            offs = rm.to(tl.int64)[:, None] * stride_om + cols[None, :]
            tl.store(out_ptr + offs, silu_mul(gate, up, dtype).to(dtype),
                     mask=(rm[:, None] < M) & (cols[None, :] < N // 2))  # fmt: skip
        else:
            tl.store(out_ptr + offs, acc.to(dtype), mask=mask)


@triton.jit
def _split_k_sum(part_ptr, b_ptr, rn, b_rn, mask, stride_ps, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # a fixed order: the same bits on every run
        acc += tl.load(part_ptr + s * stride_ps + rn, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + b_rn, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _split_k_reduce_kernel(
    part_ptr, b_ptr, out_ptr, N, stride_pm, stride_ps, stride_om,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    # N: the output's columns (GATED: half the partial sums', gate rows then up rows)
    m = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = rn < N
    part_ptr += m * stride_pm
    dtype = out_ptr.dtype.element_ty
    if GATED:
        gate = _split_k_sum(part_ptr, b_ptr, rn, rn, mask, stride_ps, SPLIT_K, HAS_BIAS, BLOCK)
        up = _split_k_sum(part_ptr, b_ptr, N + rn, N + rn, mask, stride_ps, SPLIT_K, HAS_BIAS, BLOCK)
        out = silu_mul(gate, up, dtype)
    else:
        out = _split_k_sum(part_ptr, b_ptr, rn, rn, mask, stride_ps, SPLIT_K, HAS_BIAS, BLOCK)
    tl.store(out_ptr + m * stride_om + rn, out.to(dtype), mask=mask)


def skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: GemvConfig,
    scales: tuple[torch.Tensor, torch.Tensor, int] | None = None, out_dtype: torch.dtype | None = None,
    gated: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``x @ weight.T + bias`` for 2-D ``x`` [M, K] and ``weight`` [N, K], both with unit
    stride along K; fp32 accumulation, output in ``out_dtype`` (default: ``x``'s dtype).
    ``gated``: ``silu_and_mul`` of that, [M, N / 2], from one launch (or the split-K reduction's):
    the bits of the two ops (an even ``cfg.block_n``: a program's gate rows and their up rows).

    ``scales`` = (``x_scale`` [M, groups], ``weight_scale`` [N, groups], ``group_k``) for e4m3
    ``x`` and ``weight``: ``reference_fp8.w8a8_matmul``'s product. Block scales (``group_k`` > 0)
    step one group at a time (``cfg.block_k`` is replaced by ``group_k``); per-channel ones
    (``group_k`` 0, one scale column) apply once. Any scale strides. ``x_scale`` None (block
    scales only): ``x`` is 16-bit and is quantised in the kernel, 1 x ``group_k`` per row, to
    the codes and scales of ``per_token_group_quant_fp8`` (one launch fewer per layer)."""
    m, k = x.shape
    n = weight.shape[0]
    if gated and (n % 2 or cfg.block_n % 2):
        raise ValueError(f"gated: {n} weight rows and {cfg.block_n} a program must be even")
    n_out = n // 2 if gated else n
    out = torch.empty((m, n_out), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    x_scale, w_scale, group_k = scales if scales is not None else (out, out, 0)
    quant_x = scales is not None and x_scale is None
    if quant_x and not group_k:
        raise ValueError("quantising the activations in the kernel needs block scales (group_k > 0)")
    x_scale = out if quant_x else x_scale
    mode = _MODES[cfg.mode]
    block_k = group_k or cfg.block_k
    if group_k and mode == _MODES["defer"]:
        raise ValueError("the defer mode reduces once at the end: it cannot apply block scales per key step")
    block_m = max(triton.next_power_of_2(m), 16 if mode >= 2 else 1)
    split_k = min(cfg.split_k, triton.cdiv(k, block_k))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty split
    even_k = k % k_per_split == 0
    partial = split_k > 1
    target = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if partial else out
    b = bias if bias is not None else out
    grid = (triton.cdiv(n, cfg.block_n), split_k)
    _skinny_gemm_kernel[grid](
        x, weight, b, target, x_scale, w_scale, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), target.stride(-2), target.stride(0) if partial else 0,
        x_scale.stride(0), x_scale.stride(1), w_scale.stride(0), w_scale.stride(1),
        HAS_BIAS=bias is not None, PARTIAL=partial, EVEN_K=even_k, MODE=mode,
        SCALES=0 if scales is None else 2 if group_k else 1,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, QUANT_X=quant_x, GATED=gated,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if partial:  # gated: half the columns a program, as many programs as the plain reduction's
        block = min(triton.next_power_of_2(n_out), 512 if gated else 1024)
        _split_k_reduce_kernel[(m, triton.cdiv(n_out, block))](
            target, b, out, n_out, target.stride(1), target.stride(0), out.stride(0),
            SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=block, GATED=gated, num_warps=4,
        )  # fmt: skip
    return out


def pick_config(m: int, n: int, k: int) -> GemvConfig:
    """The launch configuration for an [m, k] x [n, k]^T product; it depends on m only
    through its power-of-two bucket, as the compiled variants do.

    At 1-2 rows (H200 sweep, tests/gpu/gemv_bench.py, 13 projections of Qwen3-0.6B/8B and
    Qwen2.5-7B): two warps, a weight tile of 4 rows x 1024 keys, narrowed to 2 or 1 rows until
    there are enough programs to keep every SM's loads in flight (short rows need more), and
    2048 keys where K is long or not a multiple of 1024 (fewer masked steps); the LM head's
    vocabulary-wide weight takes 2 x 2048. On the H200 3-16% faster than the earlier H100 pick
    (4 x 1024, four warps) on every shape (8B's four projections 111.2 -> 103.6 us a layer, the
    LM head 298 -> 282 us); on the H100 within 2% of it on the 8B projections, 4-16% faster on
    0.6B's, and within 1-8% of the grid's best everywhere (docs/performance.md, session 16)."""
    if triton.next_power_of_2(m) <= 2:
        if n >= WIDE_N:
            return GemvConfig(block_n=2, block_k=2048, num_warps=2, num_stages=2)
        min_programs = 2048 if k <= 1024 else 768
        block_n = 4
        while block_n > 1 and n // block_n < min_programs:
            block_n //= 2
        block_k = 1024 if k <= 4096 and k % 1024 == 0 else 2048
        return GemvConfig(block_n, min(block_k, triton.next_power_of_2(k)), num_warps=2, num_stages=2)
    return GemvConfig(block_n=32, block_k=128, mode="dot", num_warps=4, num_stages=4)


def use_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``linear`` takes the skinny kernel: few rows (more for a vocabulary-wide
    weight), 16-bit activations, weight and bias of one dtype, unit stride along K."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    max_rows = WIDE_MAX_ROWS if weight.shape[0] >= WIDE_N else MAX_ROWS
    return (
        0 < rows <= max_rows
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.stride(-1) == 1
        and (bias is None or (bias.dtype == x.dtype and bias.stride(0) == 1))
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; the skinny kernel for a few rows, cuBLAS (via torch) otherwise. The
    choice is made here, inside the op, so a compiled graph does not specialise on M."""
    if not use_skinny(x, weight, bias):
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = skinny_gemm(x2, weight, bias, pick_config(x2.shape[0], weight.shape[0], weight.shape[1]))
    return out.view(*x.shape[:-1], weight.shape[0])


# Up to this many rows ``gated_linear`` applies the activation in the skinny kernel's epilogue, one launch
# fewer a layer (0: never; the skinny kernel, then silu_and_mul's launch). H100, session 36
# (tests/gpu/decode_chain.py, Qwen3-8B's layer minus attention at one row, CUDA-graph replay): 140.4-140.6 us a
# layer against 141.4-141.5 without, in two trees of one call (the gate_up launch unchanged at 4 rows a program)
GATED_MAX_ROWS = 1


def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu_and_mul(linear(x, weight, bias))`` for a gate-then-up ``weight`` [2 I, K]: up to
    ``GATED_MAX_ROWS`` rows one skinny-kernel launch, the same bits."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    n = weight.shape[0]
    if rows > GATED_MAX_ROWS or n % 2 or not use_skinny(x, weight, bias):
        return silu_and_mul(linear(x, weight, bias))
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    cfg = pick_config(rows, n, weight.shape[1])
    cfg = replace(cfg, block_n=cfg.block_n + cfg.block_n % 2)  # gate rows with their up rows
    return skinny_gemm(x2, weight, bias, cfg, gated=True).view(*x.shape[:-1], n // 2)
