"""Sample one token per row for the whole batch in one pass.

Greedy rows take the argmax. Other rows divide by their temperature, drop what top-k,
top-p and min-p exclude, and draw with the exponential race (``argmax(p / E)``, E ~ Exp(1)),
which samples from ``p`` without a cumulative sum. A request with a ``seed`` draws its E
from its own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom import ops


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor | None  # [B] int32, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [B] float32, 1 = off
    min_p: torch.Tensor | None  # [B] float32, 0 = off
    generators: list[torch.Generator | None]  # per row; None = the shared default generator
    all_greedy: bool


def _exponential_noise(shape: tuple[int, int], generators, device) -> torch.Tensor:
    noise = torch.empty(shape, device=device, dtype=torch.float32).exponential_()
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    return noise


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if t.all_greedy:
        return greedy
    temps = torch.where(t.temperatures > 0, t.temperatures, 1.0)
    scaled = logits / temps[:, None]
    if t.top_k is not None or t.top_p is not None or t.min_p is not None:
        scaled = ops.top_k_top_p_min_p(scaled, t.top_k, t.top_p, t.min_p)
    probs = torch.softmax(scaled, dim=-1)
    sampled = (probs / _exponential_noise(probs.shape, t.generators, probs.device)).argmax(dim=-1)
    return torch.where(t.temperatures > 0, sampled, greedy)
