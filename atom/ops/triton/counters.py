"""Launch counters: int32 slots on a device that are zero between kernel launches.

A kernel counts its programs in (atomic adds) and the program that sees the last count zeroes its
slot again before the launch ends: the Gluon prefill's dynamic scheduler (``prefill_attention_gluon``).
(Session 37's split-K sums and split merges folded into their launch's last program used it too; both
lost on an H100 in session 38 and were removed: docs/performance.md.) Launches on one device do not
overlap (one stream), so they all share one buffer. First asked for in an eager forward (the warm-up
that precedes every CUDA-graph capture), so the buffer is never a graph's private allocation."""

from __future__ import annotations

import functools

import torch

SLOTS = 1 << 16


@functools.cache
def launch_counters(device: torch.device) -> torch.Tensor:
    return torch.zeros(SLOTS, dtype=torch.int32, device=device)
