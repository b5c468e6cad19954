"""Merge of split-K attention partials: programs that each attended to one segment of a row's
keys wrote unnormalised partial results (output sum, running max and exp-sum in the log2
domain); one program per (token, head) combines them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def with_columns(mask, offs_d, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """``mask`` and, for a head_dim padded to a power of two, the real columns of ``offs_d``
    (broadcast against each other); ``mask`` alone when there is no padding, so a power-of-two
    head_dim compiles the same code as without this."""
    if HEAD_DIM_PAD == HEAD_DIM:
        out = mask
    else:
        out = mask & (offs_d < HEAD_DIM)
    return out


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # a head_dim that is not a power of two: padded, masked
    s_ok = offs_s < num_splits
    row = (tok * num_heads + head) * num_splits + offs_s
    m = tl.load(part_max_ptr + row, mask=s_ok, other=float("-inf"))
    l = tl.load(part_sum_ptr + row, mask=s_ok, other=0.0)
    # Splits that saw no key have m = -inf and l = 0: weight 0, and their output rows (never
    # stored) are not read.
    saw = s_ok & (m > float("-inf"))
    acc = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=with_columns(saw[:, None], offs_d[None, :], HEAD_DIM, HEAD_DIM_PAD), other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - m_max)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    if HEAD_DIM_PAD == HEAD_DIM:
        tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
                 mask=offs_d < HEAD_DIM)


def split_partials(num_tokens: int, num_heads: int, num_splits: int, head_dim: int, device) -> tuple:
    """Partial output, max and sum buffers, [token, head, split, ...] in float32."""
    part_out = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    part_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=device)
    return part_out, part_max, torch.empty_like(part_max)


def merge_splits(out: torch.Tensor, part_out: torch.Tensor, part_max: torch.Tensor, part_sum: torch.Tensor) -> None:
    """Normalise and combine the partials into ``out`` [tokens, heads, head_dim]."""
    num_tokens, num_heads, num_splits, head_dim = part_out.shape
    _merge_splits_kernel[(num_tokens, num_heads)](
        out, part_out, part_max, part_sum, num_heads, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_S=triton.next_power_of_2(num_splits),
        num_warps=4,
    )  # fmt: skip
