"""Shared by the CPU (interpreter) and GPU tests of the sampling kernel."""

import torch

from atom.ops import reference, sampling


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


def check_tokens(kernel, logits, temps, top_k, top_p, min_p, seeds):
    """Run ``kernel`` (a ``sample_tokens``) and check its tokens against the reference's: they
    draw the same Philox noise, so they differ only by float rounding at a cut or a near-tie
    of the race."""
    out = kernel(logits, temps, top_k, top_p, min_p, seeds)
    expect = sampling.sample_tokens(logits, temps, top_k, top_p, min_p, seeds)
    greedy = temps <= 0
    assert torch.equal(out[greedy], logits[greedy].argmax(dim=-1))
    # Where they differ, the kernel's token must be kept (or at a rounding-sensitive cut) and
    # score within rounding of the reference's winner.
    scaled = logits.float() / torch.where(greedy, 1.0, temps)[:, None]
    kept = ~reference.top_k_top_p_min_p(scaled, top_k, top_p, min_p).isinf()
    sensitive = rounding_sensitive(scaled, top_k, top_p, min_p)
    score = scaled + sampling.gumbel_from_bits(sampling.philox_bits(seeds, logits.shape[-1]))
    for row in torch.nonzero(out != expect).flatten().tolist():
        tok = int(out[row])
        assert kept[row, tok] or sensitive[row, tok], f"row {row}: token {tok} is filtered out"
        best = score[row][kept[row] & ~sensitive[row]].max()
        assert score[row, tok] >= best - 1e-4 * (1 + best.abs()), f"row {row}: {tok} instead of {int(expect[row])}"
    return out
