"""The one forward context: attention metadata for the batch being run.

The model runner builds an ``AttentionMetadata`` for each step and enters
``set_forward_context`` around the model's forward; attention layers read it with
``get_forward_context``. Models never take metadata arguments (vLLM passes metadata the
same way, which keeps plugin mode thin).

The context is a ``ForwardContext`` object held in a ``contextvars.ContextVar``, not a
module global: each thread (and asyncio task) sees its own, and leaving the ``with``
block restores the enclosing one, so nested uses (CUDA graph capture inside the runner's
context, a draft model inside a target step) cannot leak into each other.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (-1: padding)
    cu_seqlens_q: torch.Tensor  # [B+1] int32: query rows of each sequence
    seq_lens: torch.Tensor  # [B] int32: tokens of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_seqlen_q: int
    max_seqlen_k: int
    num_decode_tokens: int = 0  # rows with q_len == 1, placed first
    # host copies of cu_seqlens_q and seq_lens where the builder has them: ops that need the
    # lengths on the host (the MLA prompt attention) read these instead of syncing with the device
    cu_seqlens_q_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None


@dataclass(frozen=True, slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    positions: torch.Tensor | None = None
    # attention layers by prefix, for the opaque attention op that torch.compile keeps whole
    attn_layers: dict | None = None


_CURRENT: ContextVar[ForwardContext | None] = ContextVar("atom_forward_context", default=None)


def get_forward_context() -> ForwardContext:
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError("no forward context: run the model inside set_forward_context(...)")
    return ctx


@contextlib.contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None, positions: torch.Tensor | None = None,
                        attn_layers: dict | None = None):
    ctx = ForwardContext(attn_metadata, positions, attn_layers)
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
