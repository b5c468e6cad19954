"""SiLU-gated activation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """``silu(gate) * up`` in float32, rounded where the model-dtype ops round: each input to ``dtype``
    (a linear layer's output; a no-op on values loaded in it) and silu before the multiply, as the
    reference does. Kernels that fuse the activation into a GEMM's epilogue call it on their
    accumulators, so they give the bits of the GEMM then ``silu_and_mul``."""
    gate = gate.to(dtype).to(tl.float32)
    return (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_out + cols, silu_mul(gate, up, dtype).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0:
        return out
    out2 = out.view(-1, d)
    block = min(triton.next_power_of_2(d), 1024)
    grid = (x2.shape[0], triton.cdiv(d, block))
    _silu_and_mul_kernel[grid](x2, out2, d, x2.stride(0), out2.stride(0), BLOCK=block, num_warps=4)  # fmt: skip
    return out
