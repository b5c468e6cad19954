"""Shared by the CPU (interpreter) and GPU tests of the sampling kernel."""

import torch


def rounding_sensitive(logits, top_k, top_p, min_p, eps=1e-5):
    """Tokens whose fate hinges on float rounding: top-p's mass before the token, or
    min-p's probability ratio, within ``eps`` of the cut (computed in float64)."""
    x = logits.double()
    vocab = x.shape[-1]
    sensitive = torch.zeros_like(x, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab, top_k).clamp(max=vocab)
        kth = x.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None].long())
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None:
        probs = x.softmax(dim=-1)
        sorted_probs, idx = probs.sort(dim=-1, descending=True)
        near = ((sorted_probs.cumsum(-1) - sorted_probs) - top_p.double()[:, None]).abs() < eps
        sensitive |= torch.zeros_like(sensitive).scatter(1, idx, near & (top_p[:, None] < 1))
    if min_p is not None:
        ratio = (x - x.max(dim=-1, keepdim=True).values).exp()
        sensitive |= (ratio - min_p.double()[:, None]).abs() < eps * min_p.double()[:, None]
    return sensitive
