"""What edits the logits before temperature, in one batched pass: the grammar mask of
structured output, then the penalties and masks of ``penalty_inputs`` (vLLM's order; the
grammar mask commutes with them, so it joins ``allowed_token_ids`` as one bitmask)."""

from __future__ import annotations

import dataclasses

import torch

from atom import ops
from atom.worker.penalty_inputs import PenaltyInputs


def _neutral(rows: int, device: torch.device) -> PenaltyInputs:
    zeros = torch.zeros(rows, dtype=torch.float32, device=device)
    return PenaltyInputs(zeros, zeros, torch.ones_like(zeros), None, None, None, None, None, None)


def apply_logits_processors(
    logits: torch.Tensor, penalties: PenaltyInputs | None, grammar_bitmask: torch.Tensor | None
) -> torch.Tensor:
    """Float32 logits with both applied (``logits`` itself when neither is given).
    ``grammar_bitmask``: int32 [>= B, ceil(V / 32)] on any device, rows past B ignored."""
    if penalties is None and grammar_bitmask is None:
        return logits
    rows = logits.shape[0]
    penalties = penalties or _neutral(rows, logits.device)
    if grammar_bitmask is not None:
        mask = grammar_bitmask[:rows].to(logits.device, non_blocking=True)
        if penalties.allowed_bitmask is not None:
            mask = mask & penalties.allowed_bitmask
        penalties = dataclasses.replace(penalties, allowed_bitmask=mask)
    return ops.apply_penalties(logits, *penalties.args())  # Triton on CUDA, the reference elsewhere
