"""Launch counters: int32 slots on a device that are zero between kernel launches.

A kernel counts its programs in (atomic adds) and the program that sees the last count zeroes its
slot again before the launch ends: the last of a column block's split-K programs adds the partial
sums (``gemv``), the last of a tile's key-range splits merges them (``attention``), the dynamic
scheduler's last draw (``prefill_attention_gluon``). Launches on one device do not overlap (one
stream), so they all share one buffer. First asked for in an eager forward (the warm-up that
precedes every CUDA-graph capture), so the buffer is never a graph's private allocation."""

from __future__ import annotations

import functools

import torch

SLOTS = 1 << 16


@functools.cache
def launch_counters(device: torch.device) -> torch.Tensor:
    return torch.zeros(SLOTS, dtype=torch.int32, device=device)
