"""DeepSeek's expert routing: top-k within the best expert groups.

One function for both generations. DeepSeek-V2 scores experts with a softmax and picks
groups by their best expert (``group_limited_greedy``; plain ``greedy`` has one group);
DeepSeek-V3 scores with a sigmoid, adds the ``noaux_tc`` load-balancing bias to the scores
used for the choice only, and picks groups by the sum of their two best experts. The
weights are the chosen experts' unbiased scores, optionally renormalised, times
``routed_scaling_factor``. Routing runs in float32 (as Hugging Face does).
"""

from __future__ import annotations

import torch


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str,
    num_groups: int,
    topk_groups: int,
    correction_bias: torch.Tensor | None,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weights float32 [T, k], ids int64 [T, k])."""
    logits = router_logits.float()
    if scoring == "sigmoid":
        scores = logits.sigmoid()
    elif scoring == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"unknown expert scoring function {scoring!r} (expected 'sigmoid' or 'softmax')")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1 and topk_groups < num_groups:
        grouped = choice.view(choice.shape[0], num_groups, -1)
        if correction_bias is None:
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = group_scores.topk(topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape_as(choice)
        # V2 zeroes the other groups' softmax scores, V3 rules them out
        choice = choice.masked_fill(~keep, 0.0 if correction_bias is None else float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = (scores if correction_bias is not None else choice).gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids
