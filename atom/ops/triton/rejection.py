"""The rejection step of speculative decoding (semantics: ``atom.ops.rejection``).

One program per row walks its drafts in order; the vocabulary-wide work (probabilities,
the recovered tokens) is done beforehand, so the kernel reads [B, K] tensors only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rejection_kernel(
    out_ptr,
    draft_ptr,
    num_drafts_ptr,
    argmax_ptr,
    target_p_ptr,
    draft_p_ptr,
    uniform_ptr,
    recovered_ptr,
    bonus_ptr,
    greedy_ptr,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    n = tl.load(num_drafts_ptr + b)
    valid = j < n
    is_greedy = tl.load(greedy_ptr + b) != 0
    d = tl.load(draft_ptr + b * K + j, mask=valid, other=0)
    argmax = tl.load(argmax_ptr + b * K + j, mask=valid, other=0)
    tp = tl.load(target_p_ptr + b * K + j, mask=valid, other=0.0)
    dp = tl.load(draft_p_ptr + b * K + j, mask=valid, other=0.0)
    u = tl.load(uniform_ptr + b * K + j, mask=valid, other=1.0)
    recovered = tl.load(recovered_ptr + b * K + j, mask=valid, other=0)
    ok = tl.where(is_greedy, d == argmax, (dp > 0) & (u * dp < tp))
    alt = tl.where(is_greedy, argmax, recovered)
    # drafts are accepted up to the first rejection; that position takes ``alt``
    first = tl.min(tl.where(valid & (ok == 0), j, BLOCK), axis=0)
    accepted = tl.minimum(first, n)
    tl.store(out_ptr + b * (K + 1) + j, d, mask=j < accepted)
    tl.store(out_ptr + b * (K + 1) + j, alt, mask=(j == accepted) & valid)
    bonus = tl.load(bonus_ptr + b)
    tl.store(out_ptr + b * (K + 1) + accepted, bonus, mask=accepted == n)


def rejection_sample(
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    target_argmax: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    uniform: torch.Tensor,
    recovered: torch.Tensor,
    bonus: torch.Tensor,
    greedy: torch.Tensor,
) -> torch.Tensor:
    batch, k = draft_ids.shape
    out = torch.full((batch, k + 1), -1, dtype=torch.int64, device=draft_ids.device)
    if batch:
        c = lambda t: t.contiguous()  # noqa: E731
        _rejection_kernel[(batch,)](
            out,
            c(draft_ids),
            c(num_drafts),
            c(target_argmax),
            c(target_probs.float()),
            c(draft_probs.float()),
            c(uniform.float()),
            c(recovered),
            c(bonus),
            c(greedy),
            K=k,
            BLOCK=triton.next_power_of_2(k),
        )
    return out
