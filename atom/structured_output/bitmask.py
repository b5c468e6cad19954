"""The batch's token bitmask: one int32 row of ceil(vocab / 32) words per request (xgrammar's
layout: bit j of word w allows token 32 w + j), all ones for unconstrained rows."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from atom.ops.penalties import unpack_bitmask
from atom.structured_output.matcher import GrammarState
from atom.structured_output.xgrammar_import import xgrammar


def allocate(rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU bitmask (xgrammar fills it on the host; copy it to the logits' device to apply)."""
    return xgrammar().allocate_token_bitmask(rows, vocab_size)


def fill(bitmask: torch.Tensor, states: Sequence[GrammarState | None]) -> bool:
    """Fill ``bitmask[:len(states)]``; rows whose state is None (or terminated) allow every
    token. Returns whether any row is constrained (if not, skip applying it)."""
    constrained = False
    for row, state in enumerate(states):
        if state is None or state.is_terminated:
            bitmask[row].fill_(-1)
        else:
            state.fill_bitmask(bitmask, row)
            constrained = True
    return constrained


def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the disallowed logits of each row to -inf, in place. ``bitmask`` covers the first
    ``logits.shape[0]`` rows; on the logits' device, or CPU (copied over)."""
    rows, vocab = logits.shape
    bitmask = bitmask[:rows].to(logits.device, non_blocking=True)
    if logits.dtype == torch.float32 and logits.is_contiguous() and logits.device.type in ("cpu", "cuda"):
        xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
    else:
        logits.masked_fill_(~unpack_bitmask(bitmask, vocab), float("-inf"))
