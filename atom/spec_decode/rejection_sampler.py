"""Verify draft tokens against the target's logits (vLLM's rejection sampling).

Greedy rows accept a draft while it is the target's argmax, which makes the output
token-identical to decoding without drafts. Sampling rows accept draft ``d`` with
probability ``min(1, p_target(d) / p_draft(d))`` and on rejection draw from the normalised
``max(0, p_target - p_draft)``; the accepted run followed by that draw (or by the bonus
token after a fully accepted run) is distributed exactly as sampling from the target
(Leviathan et al., Chen et al. 2023). ``p_target`` is the distribution the plain sampler
draws from: temperature, then top-k, top-p and min-p.

Proposers here draft greedily, so ``draft_probs`` is None (a one-hot draft distribution);
a proposer that samples its drafts passes their distributions.
"""

from __future__ import annotations

import torch

from atom import ops


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    """The plain sampler's distribution of each row (any temperature > 0 on greedy rows)."""
    temps = torch.where(temperature > 0, temperature, 1.0)
    scaled = logits.float() / temps[:, None]
    if top_k is not None or top_p is not None or min_p is not None:
        scaled = ops.top_k_top_p_min_p(scaled, top_k, top_p, min_p)
    return torch.softmax(scaled, dim=-1)


def _noise(shape: tuple[int, ...], generators: list[torch.Generator | None], device, uniform: bool) -> torch.Tensor:
    """Per-row random numbers ([B, ...]); a row with its own generator draws from it, so a
    seeded request does not depend on the rest of the batch."""
    out = torch.empty(shape, dtype=torch.float32, device=device)
    out.uniform_() if uniform else out.exponential_()
    for row, gen in enumerate(generators):
        if gen is not None:
            out[row].uniform_(generator=gen) if uniform else out[row].exponential_(generator=gen)
    return out


def rejection_sample(
    logits: torch.Tensor,  # [B, K, V]: the target's logits at each draft position
    draft_ids: torch.Tensor,  # [B, K] int64
    num_drafts: torch.Tensor,  # [B] int64
    bonus: torch.Tensor,  # [B] int64: the token sampled after the last draft
    temperature: torch.Tensor,  # [B] float32, 0 = greedy
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    generators: list[torch.Generator | None] | None = None,
    draft_probs: torch.Tensor | None = None,  # [B, K, V]; None: drafts were argmax picks
    all_greedy: bool | None = None,  # whether every row is greedy, where the host knows (no device sync)
) -> torch.Tensor:
    """[B, K + 1] int64: each row's accepted drafts, then one sampled token, then -1s."""
    b, k, v = logits.shape
    generators = generators or [None] * b
    greedy = (temperature <= 0).to(torch.int32)
    argmax = logits.argmax(dim=-1)
    rep = lambda t: None if t is None else t.repeat_interleave(k)  # noqa: E731
    if bool(greedy.all()) if all_greedy is None else all_greedy:
        probs_d = draft_p = uniform = torch.ones(b, k, device=logits.device)
        recovered = argmax
    else:
        probs = target_probs(logits.reshape(b * k, v), rep(temperature), rep(top_k), rep(top_p), rep(min_p))
        probs = probs.view(b, k, v)
        probs_d = probs.gather(2, draft_ids[..., None]).squeeze(2)
        if draft_probs is None:  # one-hot: the residual is the target with the draft removed
            residual = probs.scatter(2, draft_ids[..., None], 0.0)
            draft_p = torch.ones(b, k, device=logits.device)
        else:
            residual = (probs - draft_probs).clamp_min(0.0)
            draft_p = draft_probs.gather(2, draft_ids[..., None]).squeeze(2)
        # the exponential race draws from the residual without normalising it
        recovered = (residual / _noise((b, k, v), generators, logits.device, uniform=False)).argmax(dim=-1)
        uniform = _noise((b, k), generators, logits.device, uniform=True)
    return ops.rejection_sample(draft_ids, num_drafts, argmax, probs_d, draft_p, uniform, recovered, bonus, greedy)
