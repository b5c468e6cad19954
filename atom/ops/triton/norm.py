"""RMSNorm with an optional fused residual add."""

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
    n_cols,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
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
    tl.store(out_ptr + row * stride_out + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D [rows, hidden] tensor with unit stride along hidden."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    x2 = _rows(x)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if residual is not None:
        res_dtype = torch.promote_types(x.dtype, residual.dtype)
        out_dtype = torch.promote_types(weight.dtype, res_dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        res2 = _rows(residual)
        res_out = torch.empty(x.shape, dtype=res_dtype, device=x.device)
        res_out2 = res_out.view(-1, hidden)
    else:
        res2 = res_out2 = x2  # unused: HAS_RESIDUAL is False
    if x2.shape[0] == 0:
        return out if residual is None else (out, res_out)
    block = triton.next_power_of_2(hidden)
    num_warps = min(max(block // 512, 1), 16)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        res2,
        weight,
        out2,
        res_out2,
        hidden,
        x2.stride(0),
        res2.stride(0),
        out2.stride(0),
        res_out2.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=num_warps,
    )
    return out if residual is None else (out, res_out)
