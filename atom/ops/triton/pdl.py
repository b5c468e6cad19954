"""Programmatic dependent launch (Hopper and later), opt-in with ``ATOM_TRITON_PDL=1``.

A kernel launched with ``launch_pdl`` may start its programs while the previous kernel in the
stream is still finishing: it loads what no earlier kernel writes (a weight tile), then waits
for the previous kernel's memory (``gdc_wait``) before touching anything else. A kernel lets
the *next* one launch (``gdc_launch_dependents``) at its start when it is one small wave (norms,
attention, merges), and a GEMV only once its weight is streamed, so that waiting programs never
hold the SM slots of its later waves. In a decode step at batch 1 (one small kernel after
another, inside a CUDA graph) this hides launch latency and overlaps each GEMV's first weight
tile with the kernel before it.

Every kernel that takes ``USE_PDL`` waits before its first dependent access, so the chain is
safe whatever runs between: a kernel launched without the attribute (cuBLAS, a torch op) waits
for the previous one to finish as usual, and a PDL kernel after it returns from ``gdc_wait``
at once. Off by default until measured (docs/performance.md); never on the interpreter or CPU.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with programmatic dependent launch."""
    return device.type == "cuda" and _enabled(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _enabled(index: int) -> bool:
    if os.environ.get("ATOM_TRITON_PDL", "0") != "1" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(device: torch.device) -> dict:
    """Launch keywords for a kernel that takes ``USE_PDL``: the constexpr and Triton's launch flag."""
    on = pdl_enabled(device)
    return {"USE_PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """A kernel's first step under ``USE_PDL``: let the next kernel launch, then wait for the
    previous one's memory (nothing when off)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
