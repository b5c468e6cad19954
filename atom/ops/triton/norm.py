"""RMSNorm with an optional fused residual add, and optionally its output's e4m3 codes and group scales
(``rms_norm_fp8``: what ``per_token_group_quant_fp8`` would give, in the same launch)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    q_ptr,
    qs_ptr,
    n_cols,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    stride_q,
    stride_qsm,
    stride_qsg,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to the model dtype, as in the reference, so the returned
        # residual is bit-identical to ``x + residual``.
        x = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
        x = x.to(tl.float32)
    h = x * tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    # The normalised value is rounded to the dtype of the (summed) input before the
    # weight multiply, matching ``weight * h.to(orig_dtype)``.
    if HAS_RESIDUAL:
        h = h.to(res_out_ptr.dtype.element_ty).to(tl.float32)
    else:
        h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (w * h).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)
    if GROUP:
        # the rounded output quantised as _group_quant_kernel does (the same arithmetic, the same codes);
        # padding columns are 0 and never raise a group's max
        yg = tl.reshape(y.to(tl.float32), (BLOCK // GROUP, GROUP))
        scale = tl.maximum(tl.max(tl.abs(yg), axis=1) * (1.0 / 448.0), 1e-12)
        q = tl.clamp(tl.math.div_rn(yg, scale[:, None]), -448.0, 448.0)
        tl.store(q_ptr + row * stride_q + tl.reshape(cols, (BLOCK // GROUP, GROUP)), q.to(q_ptr.dtype.element_ty),
                 mask=tl.reshape(mask, (BLOCK // GROUP, GROUP)))  # fmt: skip
        groups = tl.arange(0, BLOCK // GROUP)
        tl.store(qs_ptr + row * stride_qsm + groups * stride_qsg, scale, mask=groups * GROUP < n_cols)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D [rows, hidden] tensor with unit stride along hidden."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    out, res_out, _, _ = _launch(x, weight, eps, residual, 0)
    return out if residual is None else (out, res_out)


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, group_k: int = 128
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``rms_norm`` (out, and the summed residual or None) and ``per_token_group_quant_fp8(out, group_k)``'s
    codes [rows, hidden] and scales [rows, groups] (group-major) from the same launch, the same bits: an FP8
    GEMM that follows the norm is given the codes instead of quantising its input itself."""
    if x.shape[-1] % group_k or group_k & (group_k - 1):
        raise ValueError(f"rms_norm_fp8: {x.shape[-1]} columns are not groups of {group_k} (a power of two)")
    return _launch(x, weight, eps, residual, group_k)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, group: int):
    hidden = x.shape[-1]
    x2 = _rows(x)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if residual is not None:
        res_dtype = torch.promote_types(x.dtype, residual.dtype)
        out_dtype = torch.promote_types(weight.dtype, res_dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    out2 = out.view(-1, hidden)
    rows = x2.shape[0]
    if residual is not None:
        res2 = _rows(residual)
        res_out = torch.empty(x.shape, dtype=res_dtype, device=x.device)
        res_out2 = res_out.view(-1, hidden)
    else:
        res2 = res_out2 = x2  # unused: HAS_RESIDUAL is False
        res_out = None
    if group:
        codes = torch.empty((rows, hidden), dtype=torch.float8_e4m3fn, device=x.device)
        scales = torch.empty((hidden // group, rows), dtype=torch.float32, device=x.device).t()
    else:
        codes = scales = out2  # unused: GROUP is 0
    result = (out, res_out) + ((codes, scales) if group else (None, None))
    if rows == 0:
        return result
    block = triton.next_power_of_2(hidden)
    num_warps = min(max(block // 512, 1), 16)
    _rms_norm_kernel[(rows,)](
        x2, res2, weight, out2, res_out2, codes, scales, hidden,
        x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0), codes.stride(0), scales.stride(0),
        scales.stride(1), eps, HAS_RESIDUAL=residual is not None, BLOCK=block, GROUP=group, num_warps=num_warps,
    )  # fmt: skip
    return result
