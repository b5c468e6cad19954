"""Merge of the MLA decode kernels' split partials (``mla.py`` and ``mla_gluon.py``): each split of
a sequence's context wrote its unnormalised latent sums, running max (natural-log units) and
denominator; one program per (sequence, head) combines them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_splits"])
def _mla_merge_kernel(
    out_ptr, part_out_ptr, part_ml_ptr, num_heads, num_splits, stride_ob, stride_oh,
    RANK: tl.constexpr, BLOCK_RANK: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.arange(0, BLOCK_RANK)
    s_ok = offs_s < num_splits
    row = (seq * num_heads + head) * num_splits + offs_s
    m = tl.load(part_ml_ptr + 2 * row, mask=s_ok, other=float("-inf"))
    denom = tl.load(part_ml_ptr + 2 * row + 1, mask=s_ok, other=0.0)
    acc = tl.load(part_out_ptr + row[:, None] * BLOCK_RANK + offs_r[None, :], mask=s_ok[:, None], other=0.0)
    # splits that saw no row have m = -inf and denom = 0: weight 0 (split 0 always has one)
    w = tl.exp(m - tl.max(m, axis=0))
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(denom * w, axis=0)
    o_ptrs = out_ptr + seq * stride_ob + head * stride_oh + offs_r
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_r < RANK)


def merge_splits(out: torch.Tensor, part_out: torch.Tensor, part_ml: torch.Tensor) -> None:
    """``out`` [B, H, rank] from the splits' partial sums ``part_out`` [B, H, splits, block_rank] and
    running max / denominator ``part_ml`` [B, H, splits, 2]."""
    num_seqs, num_heads, splits, block_rank = part_out.shape
    _mla_merge_kernel[(num_seqs, num_heads)](
        out, part_out, part_ml, num_heads, splits, out.stride(0), out.stride(1),
        RANK=out.shape[2], BLOCK_RANK=block_rank, BLOCK_S=triton.next_power_of_2(splits),
    )  # fmt: skip
