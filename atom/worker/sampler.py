"""Sample one token per row for the whole batch in one pass.

Greedy rows take the argmax. Other rows divide by their temperature, drop what top-k,
top-p and min-p exclude, and draw with the Gumbel (exponential) race, which samples without
a sort or a cumulative sum: ``ops.sample_tokens``, one kernel on a GPU. Each row's noise is
Philox keyed by a seed drawn from the row's generator: a request with a ``seed`` has its own
generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom import ops

# Philox keys are drawn below this bound (any 64-bit key works; torch.randint takes int64)
_SEED_BOUND = 1 << 62


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor | None  # [B] int32, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [B] float32, 1 = off
    min_p: torch.Tensor | None  # [B] float32, 0 = off
    generators: list[torch.Generator | None]  # per row; None = the shared default generator
    all_greedy: bool


def step_seeds(generators: list[torch.Generator | None], device) -> torch.Tensor:
    """[B] int64: this step's noise key per row, from the row's own generator if it has one,
    else from the default generator (one draw for the batch)."""
    seeds = torch.randint(_SEED_BOUND, (len(generators),), device=device)
    for row, gen in enumerate(generators):
        if gen is not None:
            seeds[row] = torch.randint(_SEED_BOUND, (1,), device=device, generator=gen)[0]
    return seeds


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    if t.all_greedy:
        return logits.float().argmax(dim=-1)
    seeds = step_seeds(t.generators, logits.device)
    return ops.sample_tokens(logits, t.temperatures, t.top_k, t.top_p, t.min_p, seeds)
