"""PyTorch definitions of the FP8 (e4m3) GEMM ops: activation quantisation and the scaled
matmul. Each Triton kernel in ``atom.ops.triton.fp8_gemm`` is tested against these.

Weights are ``float8_e4m3fn`` [N, K] with a float32 scale per (output row, group of
``group_k`` input columns): ``weight_scale`` [N, ceil(K / group_k)]. A 128x128 block-scaled
checkpoint has one scale per block; it is stored expanded to one row per output row, which
serves per-tensor, per-channel and block scales alike and survives any tensor-parallel or
packed (q/k/v) split. Activations are quantised dynamically per token and per group of
``group_k`` columns; ``group_k = 0`` means the whole row (per-token activations, and one
scale column per output row: per-tensor or per-channel weights).
"""

from __future__ import annotations

import torch

from atom.ops import reference

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# smallest scale: keeps an all-zero row finite
SCALE_MIN = 1e-12


def per_token_group_quant_fp8(x: torch.Tensor, group_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K / group_k)]) with
    ``x ~ q * scale`` per group: scale = amax / 448."""
    m, k = x.shape
    group_k = group_k or k
    groups = -(-k // group_k)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group_k - k)).view(m, groups, group_k)
    # times the float32 reciprocal (what CUDA's division by a scalar does), the same on every device
    scale = (padded.abs().amax(dim=-1) * (1.0 / FP8_MAX)).clamp(min=SCALE_MIN)
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    # the scales group-major (strides (1, M)), as the Triton kernel stores them: one layout for the
    # op's fake tensor under torch.compile, whichever implementation runs
    return q.view(m, groups * group_k)[:, :k].contiguous(), scale.t().contiguous().t()


def fused_add_rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor, group_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``reference.rms_norm(x, weight, eps, residual)`` (normed, summed) and the normed rows' e4m3 codes and
    scales (``per_token_group_quant_fp8``): what an FP8 linear after the norm would compute from them."""
    out, summed = reference.rms_norm(x, weight, eps, residual)
    return out, summed, *per_token_group_quant_fp8(out.reshape(-1, out.shape[-1]), group_k)


def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_k: int, bias: torch.Tensor | None = None,
    w_block_scale: torch.Tensor | None = None, x_codes: torch.Tensor | None = None,
    x_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """An FP8 linear layer with dynamic activation scales: ``x`` [M, K] quantised 1 x ``group_k``
    per row (``per_token_group_quant_fp8``; per token where ``group_k`` is 0), times the e4m3
    ``w`` [N, K] with its scales, plus ``bias``, in ``x``'s dtype. ``w_block_scale`` (the same
    scales per 128 x 128 block, for ``torch._scaled_mm`` on a GPU) does not change the product.
    ``x_codes`` and ``x_scales``, where given, are that quantisation of ``x`` already made (by
    ``fused_add_rms_norm_fp8``): the same product, one quantisation fewer."""
    a, a_scale = (x_codes, x_scales) if x_codes is not None else per_token_group_quant_fp8(x, group_k)
    return w8a8_matmul(a, a_scale, w, w_scale, group_k, x.dtype, bias)


def dequantize(q: torch.Tensor, scale: torch.Tensor, group_k: int) -> torch.Tensor:
    """e4m3 [R, K] times float32 scales [R, ceil(K / group_k)] -> float32 [R, K]."""
    return q.float() * scale.repeat_interleave(group_k or q.shape[-1], dim=-1)[..., : q.shape[-1]]


def w8a8_matmul(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_k: int,
    out_dtype: torch.dtype, bias: torch.Tensor | None = None, w_block_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dequantize(a) @ dequantize(w).T`` in float32 (+ bias), in ``out_dtype``. ``a`` [M, K]
    e4m3 with ``a_scale`` [M, ceil(K / group_k)]; ``w`` [N, K] with ``w_scale`` [N, ceil(K / group_k)]
    (one column when ``group_k`` is 0: per-channel). ``w_block_scale``, the same scales once per
    128x128 block, only lets the GPU pick cuBLASLt's block-scaled GEMM: unused here."""
    out = dequantize(a, a_scale, group_k) @ dequantize(w, w_scale, group_k).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def quantize_weight(w: torch.Tensor, group_k: int = 0, block_n: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A high-precision weight [N, K] -> (e4m3, row-expanded scales): per output channel
    (``group_k`` 0) or per ``block_n`` x ``group_k`` block. Used by ``--quantization fp8``
    (per channel) and by tests writing checkpoints."""
    n, k = w.shape
    gk = group_k or k
    rows, cols = -(-n // block_n), -(-k // gk)
    padded = torch.nn.functional.pad(w.float(), (0, cols * gk - k, 0, rows * block_n - n))
    blocks = padded.view(rows, block_n, cols, gk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=SCALE_MIN)  # [rows, cols]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(rows * block_n, cols * gk)
    return q[:n, :k].contiguous(), scale.repeat_interleave(block_n, dim=0)[:n].contiguous()


def fused_moe_fp8(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, group_k: int,
) -> torch.Tensor:
    """``atom.ops.reference.fused_moe`` with e4m3 expert weights [E, N, K] and row-expanded
    scales [E, N, ceil(K / group_k)]; each expert GEMM quantises its input per token group."""
    out = torch.zeros_like(x)
    weights = topk_weights.to(x.dtype)
    for e in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == e)
        h = w8a8_matmul(*per_token_group_quant_fp8(x[token_idx], group_k), w13[e], w13_scale[e], group_k, x.dtype)
        gate, up = h.chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
        h = w8a8_matmul(*per_token_group_quant_fp8(h, group_k), w2[e], w2_scale[e], group_k, x.dtype)
        out.index_add_(0, token_idx, h * weights[token_idx, slot, None])
    return out
