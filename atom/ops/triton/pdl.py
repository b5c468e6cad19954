"""Programmatic dependent launch (PDL, Hopper and later) for the batch-1 decode chain.

A kernel launched with PDL may start while the kernel before it in the stream still runs, as soon
as all of that kernel's programs have called ``griddepcontrol.launch_dependents`` (or exited); it
must ``griddepcontrol.wait`` before it reads what that kernel wrote (the wait returns when the
kernel before has finished and its writes are visible). Both instructions do nothing in a kernel
launched without PDL.

The skinny GEMMs of batch-1 decode each stream 17-100 MB of weights and carry ~5 us of ramp-up and
tail over their bytes at the copy rate (docs/fp8.md, session 31): launched with PDL, a GEMM's
programs ask L2 for the first ``PREFETCH_BYTES`` of each of their weight rows (one bulk prefetch a
row), then wait for the norm, attention merge or activation before it, which signal at their start.
``ATOM_PDL=1`` turns it on (off until measured end to end).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = os.environ.get("ATOM_PDL", "0") == "1"
# bytes of each weight row a PDL GEMM program prefetches before its wait: enough to cover the kernel
# before it (a norm: ~2-3 us; attention and its merge at batch 1: ~10 us) without flooding L2
PREFETCH_BYTES = 1024


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels over ``t`` take part: ``ATOM_PDL=1``, a Hopper-or-later GPU, not the interpreter."""
    return ENABLED and t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1" and _hopper(t.device.index or 0)


def launch(on: bool) -> dict:
    """The launch keyword that asks for PDL (none when off: the interpreter does not take it)."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def signal(PDL: tl.constexpr):
    """At a kernel's start: the next kernel (if launched with PDL) may start as this one's programs run."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Before the first read of what the kernel before wrote (and before any write)."""
    if PDL:
        gdc_wait()


@triton.jit
def prefetch_rows(row_ptrs, nbytes, PDL: tl.constexpr):
    """Asks L2 for ``nbytes`` (a multiple of 16, from 16-byte aligned addresses) at each of ``row_ptrs``:
    one bulk prefetch a row, no registers held."""
    if PDL:
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
            "=r,l,r",
            [row_ptrs, nbytes],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
