"""FP8 (e4m3) GEMM: per-token-group activation quantisation and a scaled matmul whose
weight scales are per (output row, group of ``group_k`` input columns), see
``atom.ops.reference_fp8`` for the semantics.

With block scales (``group_k`` > 0) the key loop steps one scale group at a time and
rescales each partial product in float32 (DeepSeek-V3's scheme); with per-channel scales
(``group_k`` = 0) the whole K loop accumulates raw products and the scales apply once at
the end. Block scales are read one key step ahead (their load latency then hides behind
the current step's MMA) and are best stored K-major: the quantisation writes activation
scales column-major, and the FP8 linear layer keeps weight scales K-major, so each step's
scale vector is one contiguous read. Small batches split the key range over several
programs (float32 partial sums, added after) to fill the GPU. Tile shapes come from
``atom.ops.triton.fp8_configs`` (swept on an H100 with ``tests/gpu/fp8_sweep.py``).

Up to ``SKINNY_MAX_ROWS`` rows (decode) and ``SKINNY_MAX_N`` columns ``w8a8_matmul`` runs the
weight-streaming skinny kernel of ``atom.ops.triton.gemv`` instead, with the same scales and
the same result up to float32 summation order; the choice is made inside the op, so CUDA
graphs and torch.compile see one op for every batch size. Above 16 rows, a weight given with
``w_block_scale`` (see ``scaled_mm_block_scales``; the FP8 layer's default, off with
``ATOM_FP8_SCALED_MM_BLOCK=0``) runs cuBLASLt's block-scaled GEMM through ``torch._scaled_mm``
instead of the tile kernel: 1.4-2.0x faster from 256 rows on the H100 (docs/fp8.md).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from atom.ops import reference_fp8
from atom.ops.triton.activation import silu_and_mul
from atom.ops.triton.fp8_configs import (
    GEMV_MAX_ROWS,
    SKINNY_MAX_N,
    SKINNY_MAX_ROWS,
    gemm_config,
    gemv_config,
    skinny_config,
)
from atom.ops.triton.fp8_gemv import Fp8GemvConfig, fp8_gemv
from atom.ops.triton.gemv import skinny_gemm

logger = logging.getLogger(__name__)


# the column-major scales' group stride is the row count: not specialised (1, multiples of 16)
@triton.jit(do_not_specialize=["m", "stride_sg"])
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, m, k, stride_x, stride_q, stride_sm, stride_sg, group_k,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """One group of ``ROWS`` rows a program: a (row, group) a program left most threads idle at
    128-wide groups (2.2x slower than vLLM's kernel on the fused MoE's intermediate)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    cols = group * group_k + tl.arange(0, BLOCK)
    row_ok = rows < m
    mask = row_ok[:, None] & ((cols < k) & (tl.arange(0, BLOCK) < group_k))[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # the reference's arithmetic exactly (times the float32 reciprocal of 448, then an
    # IEEE-rounded division: Triton's `/` is approximate), so the fp8 codes match bit for bit
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) * (1.0 / 448.0), 1e-12)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -448.0, 448.0)
    tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows * stride_sm + group * stride_sg, scale, mask=row_ok)


def per_token_group_quant_fp8(
    x: torch.Tensor, group_k: int, column_major: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``column_major``: the scales [M, groups] are stored group-major (strides (1, M)), the
    layout the GEMMs read fastest; the values are the same either way."""
    m, k = x.shape
    group = group_k or k
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if column_major:
        s = torch.empty((groups, m), dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        x = x if x.stride(-1) == 1 else x.contiguous()
        block = triton.next_power_of_2(group)
        # ~4k elements a program (32 rows of 128-wide groups), whatever the row count: one compiled
        # variant for every batch (a variant first met inside a step compiles there)
        rows = max(4096 // block, 1)
        _group_quant_kernel[(triton.cdiv(m, rows), groups)](
            x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1), group, ROWS=rows, BLOCK=block,
            num_warps=4,
        )  # fmt: skip
    return q, s


# the batch's rows, and the column-major activation scales' group stride (= rows): one variant
# for every row count
@triton.jit(do_not_specialize=["m", "stride_ask"])
def _w8a8_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, m, n, k,
    stride_am, stride_asm, stride_ask, stride_wn, stride_wsn, stride_wsk, stride_om, stride_os,
    PER_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # grouped launch order: GROUP_M row tiles share their weight tiles in L2
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N)
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows
    # split-K: this program sums key steps [kt_lo, kt_hi)
    steps = tl.cdiv(k, BLOCK_K)
    per_split = tl.cdiv(steps, SPLIT_K)
    kt_lo = tl.program_id(1) * per_split
    kt_hi = tl.minimum(kt_lo + per_split, steps)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < m, offs_n < n
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] + kt_lo * BLOCK_K
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] + kt_lo * BLOCK_K
    as_ptrs = as_ptr + offs_m * stride_asm
    ws_ptrs = ws_ptr + offs_n * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PER_GROUP:
        # (step indices clamped into range: a read past the split's end is never used)
        kt0 = tl.minimum(kt_lo, steps - 1)
        a_s = tl.load(as_ptrs + kt0 * stride_ask, mask=m_ok, other=0.0)
        w_s = tl.load(ws_ptrs + kt0 * stride_wsk, mask=n_ok, other=0.0)
    for kt in range(kt_lo, kt_hi):
        k_ok = offs_k < k - kt * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if PER_GROUP:
            # the next step's scales, loaded while this step's MMA runs
            nxt = tl.minimum(kt + 1, steps - 1)
            a_s_next = tl.load(as_ptrs + nxt * stride_ask, mask=m_ok, other=0.0)
            w_s_next = tl.load(ws_ptrs + nxt * stride_wsk, mask=n_ok, other=0.0)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
            a_s, w_s = a_s_next, w_s_next
        else:
            # Hopper's fp8 MMA accumulates in reduced precision: promote to float32 once per
            # step, not once per K (per-channel GEMMs over correlated inputs were off by 6-17%)
            acc = tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not PER_GROUP:
        a_s = tl.load(as_ptrs, mask=m_ok, other=0.0)
        w_s = tl.load(ws_ptrs, mask=n_ok, other=0.0)
        acc = acc * a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + tl.program_id(1) * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def w8a8_matmul(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_k: int,
    out_dtype: torch.dtype, bias: torch.Tensor | None = None, w_block_scale: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:  # fmt: skip
    """``config`` overrides the tile table (the sweep's candidates) and selects this kernel at
    any row count: BLOCK_M, BLOCK_N, BLOCK_K (per-channel only; block scales step one group),
    GROUP_M, SPLIT_K, num_warps, num_stages. Without it, up to ``SKINNY_MAX_ROWS`` rows of at
    most ``SKINNY_MAX_N`` columns run the skinny kernel (``skinny_config``), and more rows
    ``torch._scaled_mm`` where
    ``w_block_scale`` (``scaled_mm_block_scales``'s, the same scales per 128x128 block) is given."""
    m, k = a.shape
    n = w.shape[0]
    if group_k and (group_k < 16 or group_k & (group_k - 1)):
        raise ValueError(f"block-scaled FP8 GEMM needs a power-of-two group of at least 16 columns, got {group_k}")
    if config is None and m <= SKINNY_MAX_ROWS and n <= SKINNY_MAX_N:
        return skinny_gemm(a, w, bias, skinny_config(n, k, group_k), scales=(a_scale, w_scale, group_k),
                           out_dtype=out_dtype)  # fmt: skip
    if config is None and w_block_scale is not None and m > SKINNY_MAX_ROWS:  # decode-sized: measured on the tiles
        out = scaled_mm_block(a, a_scale, w, w_block_scale, out_dtype)
        return out if bias is None else out + bias
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    cfg = dict(config or gemm_config(m, n, k, group_k > 0))
    block_k = group_k or cfg.pop("BLOCK_K", 128)
    cfg.pop("BLOCK_K", None)
    split_k = min(cfg.pop("SPLIT_K", 1), triton.cdiv(k, block_k))
    # split-K: float32 partial sums [SPLIT_K, m, n], summed (and the bias added) after
    dest = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=a.device)
    has_bias = bias is not None and split_k == 1
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split_k)
    _w8a8_kernel[grid](
        a, a_scale, w, w_scale, bias if has_bias else out, dest, m, n, k,
        a.stride(0), a_scale.stride(0), a_scale.stride(1), w.stride(0), w_scale.stride(0), w_scale.stride(1),
        dest.stride(-2), dest.stride(0) if split_k > 1 else 0,
        PER_GROUP=group_k > 0, HAS_BIAS=has_bias, SPLIT_K=split_k, BLOCK_K=block_k, **cfg,
    )  # fmt: skip
    if split_k > 1:
        summed = dest.sum(0)
        out.copy_(summed if bias is None else summed + bias.float())
    return out


def _one_launch(m: int, n: int, k: int, group_k: int) -> Fp8GemvConfig | str | None:
    """How ``fp8_linear`` runs [m, k] x [n, k]^T in one launch: the CUDA-core GEMV's config, "skinny",
    or None (quantisation, then ``w8a8_matmul``)."""
    if not (group_k and 0 < m <= SKINNY_MAX_ROWS and n <= SKINNY_MAX_N):
        return None
    gemv = gemv_config(n, k, group_k) if m <= GEMV_MAX_ROWS else None
    return gemv if gemv is not None else "skinny"


def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_k: int, bias: torch.Tensor | None = None,
    w_block_scale: torch.Tensor | None = None, x_codes: torch.Tensor | None = None,
    x_scales: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``reference_fp8.fp8_linear``: ``x`` [M, K] quantised 1 x ``group_k`` per row, times the
    e4m3 weight, in ``x``'s dtype. Block scales at decode sizes (the skinny kernel's rows and
    columns) take one launch: the skinny kernel, or at one row the CUDA-core GEMV
    (``gemv_config``), quantises each activation group as it reads it. Otherwise
    ``per_token_group_quant_fp8`` then ``w8a8_matmul``. ``x_codes`` / ``x_scales`` (that quantisation,
    made by the RMS norm before) are read instead of quantising."""
    m, k = x.shape
    n = w.shape[0]
    launch = _one_launch(m, n, k, group_k)
    if launch is not None and launch != "skinny":
        if x_codes is not None:
            return fp8_gemv(x, w, w_scale, group_k, launch, bias, *_operand(x, x_codes, x_scales))
        return fp8_gemv(x if x.stride(-1) == 1 else x.contiguous(), w, w_scale, group_k, launch, bias)
    if launch == "skinny":
        a, a_scale = _operand(x, x_codes, x_scales)
        return skinny_gemm(a, w, bias, skinny_config(n, k, group_k), scales=(a_scale, w_scale, group_k),
                           out_dtype=x.dtype)  # fmt: skip
    a, a_scale = (x_codes, x_scales) if x_codes is not None else per_token_group_quant_fp8(x, group_k)
    return w8a8_matmul(a, a_scale, w, w_scale, group_k, x.dtype, bias, w_block_scale)


def _operand(
    x: torch.Tensor, x_codes: torch.Tensor | None, x_scales: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the one-launch kernels (the skinny kernel, the GEMV) read: the given codes and scales, else the
    16-bit rows and no scales (they quantise them themselves); rows contiguous along K."""
    a, a_scale = (x, None) if x_codes is None else (x_codes, x_scales)
    return (a if a.stride(-1) == 1 else a.contiguous()), a_scale


# Up to this many rows ``fp8_gated_linear`` applies SiLU-mul in the skinny kernel's epilogue (or its split-K
# reduction's), one launch fewer a layer (0: never, ``fp8_linear`` then silu_and_mul). On since session 38 (one
# H100): tests/gpu/test_fp8_gpu.py -k gated passed; Qwen3-8B-FP8's layer at one row 97.1-97.8 us against
# 98.1-98.4 (tests/gpu/decode_chain.py), batch-1 TPOT 4.281 / 4.281 ms against 4.336 / 4.337 (ABBA,
# tests/gpu/e2e_compare.py ... qwen3-8b-fp8:latency)
GATED_MAX_ROWS = 1


def fp8_gated_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_k: int, bias: torch.Tensor | None = None,
    w_block_scale: torch.Tensor | None = None, x_codes: torch.Tensor | None = None,
    x_scales: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``silu_and_mul(fp8_linear(...))`` for a gate-then-up ``w`` [2 I, K]; where ``fp8_linear`` takes the
    skinny kernel, up to ``GATED_MAX_ROWS`` rows, with the activation in that launch: the same bits."""
    m, k = x.shape
    n = w.shape[0]
    if m > GATED_MAX_ROWS or n % 2 or _one_launch(m, n, k, group_k) != "skinny":
        return silu_and_mul(fp8_linear(x, w, w_scale, group_k, bias, w_block_scale, x_codes, x_scales))
    cfg = skinny_config(n, k, group_k)  # 64 or 128 rows a program: gate rows with their up rows
    a, a_scale = _operand(x, x_codes, x_scales)
    return skinny_gemm(a, w, bias, cfg, scales=(a_scale, w_scale, group_k), out_dtype=x.dtype, gated=True)


def scaled_mm_block(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_block_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``torch._scaled_mm`` with block-wise scales, which it infers from their shapes and
    strides: ``a_scale`` [M, K/128] column-major (BlockWise1x128, as the quantisation writes
    it) and ``w_block_scale`` [K/128, N/128], the transpose of a contiguous [N/128, K/128]
    (BlockWise128x128). cuBLASLt runs it on sm90 from cuBLAS 12.9 (PyTorch's ScaledBlas.cpp), for
    row counts that are multiples of 16 only (17 rows: CUBLAS_STATUS_NOT_SUPPORTED on an H200):
    other counts run padded (the pad rows' values are never read back; each output row depends
    on its own input row only)."""
    m, k = a.shape
    rows = -(-m // 16) * 16
    if rows != m:
        padded = torch.empty((rows, k), dtype=a.dtype, device=a.device)
        padded[:m] = a
        padded_scale = torch.empty((a_scale.shape[1], rows), dtype=a_scale.dtype, device=a.device).t()
        padded_scale[:m] = a_scale
        a, a_scale = padded, padded_scale
    return torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=w_block_scale, out_dtype=out_dtype)[:m]


# (device, n, k) -> whether a trial ``scaled_mm_block`` of that shape ran and matched the
# reference: asked once per shape, when the first such weight is loaded
_SCALED_MM_BLOCK_OK: dict[tuple[str, int, int], bool] = {}


def scaled_mm_block_scales(w: torch.Tensor, w_scale: torch.Tensor, group_k: int) -> torch.Tensor | None:
    """The ``w_block_scale`` that lets ``w8a8_matmul`` run ``scaled_mm_block`` for this weight
    (e4m3 [N, K], row-expanded scales [N, K/128]), or None where it cannot: groups other than
    128 columns, N or K not multiples of 16, scales that are not one value per 128x128 block
    (a packed or split layer whose blocks do not start every 128 rows), or a torch / cuBLAS /
    GPU whose ``_scaled_mm`` refuses block-wise scales or gets a trial product wrong."""
    n, k = w.shape
    if group_k != 128 or n % 16 or k % 16:
        return None
    blocks = w_scale[::128].contiguous()
    if not torch.equal(blocks.repeat_interleave(128, dim=0)[:n], w_scale):
        return None
    key = (str(w.device), n, k)
    if key not in _SCALED_MM_BLOCK_OK:
        _SCALED_MM_BLOCK_OK[key] = _scaled_mm_block_trial(w, w_scale, blocks.t())
    return blocks.t() if _SCALED_MM_BLOCK_OK[key] else None


def _scaled_mm_block_trial(w: torch.Tensor, w_scale: torch.Tensor, w_block_scale: torch.Tensor) -> bool:
    # 17 rows: the padded path of scaled_mm_block (its multiple-of-16 path is the same call)
    rows = torch.randn(17, w.shape[1], device=w.device, generator=torch.Generator(device=w.device).manual_seed(0))
    a, a_scale = reference_fp8.per_token_group_quant_fp8(rows, 128)
    try:
        out = scaled_mm_block(a, a_scale, w, w_block_scale, torch.bfloat16)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        logger.warning("torch._scaled_mm refuses block-wise FP8 scales here, the Triton GEMM runs instead: %s",
                       str(e).splitlines()[0])  # fmt: skip
        return False
    ref = reference_fp8.w8a8_matmul(a, a_scale, w, w_scale, 128, torch.float32)
    err = (out.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
    if not err <= 2e-2:  # bf16 rounding is ~4e-3
        logger.warning("torch._scaled_mm with block-wise FP8 scales is off by %.3g (relative) on a %dx%d weight, "
                       "the Triton GEMM runs instead", err, *w.shape)  # fmt: skip
        return False
    return True
