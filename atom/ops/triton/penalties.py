"""Penalties and token masks in one pass over the logits (semantics: ``atom.ops.penalties``).

One program handles one block of one row: it reads the logits, the allowed-token bits and
the token counts once and writes the result. The sparse entries (logit_bias, min_tokens and
bad-words masks: a handful per request) are added beforehand by one scatter on the device;
they commute with the mask, and the penalties read the biased logits as vLLM's do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _penalties_kernel(
    out_ptr,
    out_stride,
    presence_ptr,
    frequency_ptr,
    repetition_ptr,
    prompt_counts_ptr,
    prompt_stride,
    output_counts_ptr,
    output_stride,
    bitmask_ptr,
    bitmask_stride,
    vocab,
    HAS_COUNTS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    x = tl.load(out_ptr + row * out_stride + offs, mask=inside, other=0.0)
    if HAS_MASK:
        words = tl.load(bitmask_ptr + row * bitmask_stride + offs // 32, mask=inside, other=0)
        allowed = ((words >> (offs % 32)) & 1) != 0
        x = tl.where(allowed, x, float("-inf"))
    if HAS_COUNTS:
        presence = tl.load(presence_ptr + row)
        frequency = tl.load(frequency_ptr + row)
        repetition = tl.load(repetition_ptr + row)
        in_prompt = tl.load(prompt_counts_ptr + row * prompt_stride + offs, mask=inside, other=0) > 0
        count = tl.load(output_counts_ptr + row * output_stride + offs, mask=inside, other=0)
        in_output = count > 0
        scale = tl.where(in_prompt | in_output, repetition, 1.0)
        x = x * tl.where(x > 0, 1.0 / scale, scale)
        x = x - frequency * count.to(tl.float32)
        x = x - tl.where(in_output, presence, 0.0)
    tl.store(out_ptr + row * out_stride + offs, x, mask=inside)


def apply_penalties(
    logits: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
    prompt_counts: torch.Tensor | None,
    output_counts: torch.Tensor | None,
    allowed_bitmask: torch.Tensor | None,
    sparse_rows: torch.Tensor | None,
    sparse_tokens: torch.Tensor | None,
    sparse_values: torch.Tensor | None,
) -> torch.Tensor:
    out = logits.to(torch.float32, copy=True)
    if sparse_rows is not None and sparse_rows.numel():
        out.index_put_((sparse_rows.long(), sparse_tokens.long()), sparse_values.float(), accumulate=True)
    has_counts = output_counts is not None
    has_mask = allowed_bitmask is not None
    if not (has_counts or has_mask):
        return out
    rows, vocab = out.shape
    # Unused pointers still need a tensor; ``out`` stands in (never read).
    prompt_counts = prompt_counts if has_counts else out
    output_counts = output_counts if has_counts else out
    bitmask = allowed_bitmask if has_mask else out
    _penalties_kernel[(rows, triton.cdiv(vocab, _BLOCK))](
        out,
        out.stride(0),
        presence,
        frequency,
        repetition,
        prompt_counts,
        prompt_counts.stride(0),
        output_counts,
        output_counts.stride(0),
        bitmask,
        bitmask.stride(0),
        vocab,
        HAS_COUNTS=has_counts,
        HAS_MASK=has_mask,
        BLOCK=_BLOCK,
    )
    return out
