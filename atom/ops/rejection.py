"""Reference of the rejection step of speculative decoding (vLLM's algorithm).

Row ``b`` verifies its first ``num_drafts[b]`` draft tokens in order. A greedy row accepts a
draft while it equals the target's argmax and otherwise takes the argmax. A sampling row
accepts draft ``d`` with probability ``min(1, p_target(d) / p_draft(d))`` (``uniform < ratio``)
and otherwise takes ``recovered``, a token drawn beforehand from the normalised
``max(0, p_target - p_draft)``. A row whose drafts are all accepted appends ``bonus``, the
token sampled from the target's distribution after the last draft.

All per-draft quantities are gathered beforehand, so the op reads [B, K] tensors only.
Returns [B, K + 1] int64: the accepted drafts, then the one sampled token, then -1s.
"""

from __future__ import annotations

import torch


def rejection_sample(
    draft_ids: torch.Tensor,  # [B, K] int64
    num_drafts: torch.Tensor,  # [B] int64, <= K
    target_argmax: torch.Tensor,  # [B, K] int64: the target's argmax at each draft position
    target_probs: torch.Tensor,  # [B, K] float32: p_target(draft)
    draft_probs: torch.Tensor,  # [B, K] float32: p_draft(draft) (1 for a greedy draft)
    uniform: torch.Tensor,  # [B, K] float32 in [0, 1)
    recovered: torch.Tensor,  # [B, K] int64: the token taken if the draft is rejected
    bonus: torch.Tensor,  # [B] int64
    greedy: torch.Tensor,  # [B] int32: 1 = greedy row
) -> torch.Tensor:
    batch, k = draft_ids.shape
    out = torch.full((batch, k + 1), -1, dtype=torch.int64, device=draft_ids.device)
    for b in range(batch):
        n, is_greedy = int(num_drafts[b]), bool(greedy[b])
        for j in range(n):
            d = int(draft_ids[b, j])
            if is_greedy:
                ok, alt = d == int(target_argmax[b, j]), int(target_argmax[b, j])
            else:
                dp = draft_probs[b, j].float()
                ok = bool(dp > 0) and bool(uniform[b, j].float() * dp < target_probs[b, j].float())
                alt = int(recovered[b, j])
            if not ok:
                out[b, j] = alt
                break
            out[b, j] = d
        else:
            out[b, n] = bonus[b]
    return out
