"""The proposer seam: what a draft method gets after a verified step, and what it returns.

A proposer sees the step as a ``DraftInputs`` and returns ``K`` draft tokens for each row
that asks for them. Rows are the ``SchedulerOutput``'s; each keeps its new tokens up to the
first rejected draft. The helpers below build attention metadata for the draft model's
own forward passes over the same block tables: the KV slots past a row's tokens were
allocated by the scheduler for this lookahead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from atom.core_types import ScheduledRequest
from atom.forward_context import AttentionMetadata
from atom.host_copy import to_device


@dataclass(frozen=True, slots=True)
class DraftInputs:
    """Row ``i`` keeps ``num_kept[i]`` new tokens at positions ``starts[i] ..`` (all of them
    unless drafts were rejected); ``next_tokens[i]`` follows them (the token just sampled,
    or the next prompt token of a partial prefill). Their target hidden states are rows
    ``offsets[i] ..`` of ``hidden``. ``propose``: the rows that want drafts."""

    requests: list[ScheduledRequest]
    starts: list[int]
    num_kept: list[int]
    next_tokens: list[int]
    offsets: list[int]
    hidden: torch.Tensor  # [T, H]: the target model's output for the step's tokens
    propose: list[int]


class Proposer(Protocol):
    num_speculative_tokens: int
    # attention layers the draft owns: the runner gives them KV cache beside the target's
    attn_layers: list[nn.Module]

    def propose(self, step: DraftInputs) -> torch.Tensor:
        """[len(step.propose), K] int64 draft tokens, in the order of ``step.propose``."""
        ...


class DraftModel(Protocol):
    """What the MTP proposer drives (``atom/models/deepseek_mtp.py``, ``llama_mtp.py``):
    the hidden state that predicts the token after ``input_ids`` from the token and the
    previous position's hidden state (the target's, or the draft's own in later steps)."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden_states: torch.Tensor
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...


def rows_metadata(
    requests: list[ScheduledRequest],
    starts: list[int],
    lengths: list[int],
    block_size: int,
    max_model_len: int,
    device: torch.device,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, metadata) of rows whose queries are ``lengths[i]`` tokens from position
    ``starts[i]`` (a handful: the kept tokens of a verify step, or one), each token as a
    decode row over its causal prefix, so the draft runs the decode kernels and its CUDA
    graphs. A position past the row's allocated slots or the model length (a draft that
    could never be verified) is clamped to the last one and writes no KV."""
    pos, slots, rows = [], [], []
    for i, (seq, start, n) in enumerate(zip(requests, starts, lengths)):
        table = seq.block_table
        limit = min(len(table) * block_size, max_model_len)
        for p in range(start, start + n):
            inside = p < limit
            p = p if inside else limit - 1
            pos.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size if inside else -1)
        rows += [i] * n
    width = max(len(s.block_table) for s in requests)
    tables = np.zeros((len(requests), width), dtype=np.int64)
    for i, seq in enumerate(requests):
        tables[i, : len(seq.block_table)] = seq.block_table
    # one host-to-device copy: positions | slots | cu_seqlens | seq_lens | block tables
    t = len(pos)
    buf = np.concatenate([pos, slots, np.arange(t + 1), np.add(pos, 1), tables[rows].reshape(-1)])
    dev = to_device(buf, torch.int64, device)
    meta = AttentionMetadata(
        slot_mapping=dev[t : 2 * t],
        cu_seqlens_q=dev[2 * t : 3 * t + 1].to(torch.int32),
        seq_lens=dev[3 * t + 1 : 4 * t + 1].to(torch.int32),
        block_tables=dev[4 * t + 1 :].view(t, width).to(torch.int32),
        max_seqlen_q=1,
        max_seqlen_k=max(pos) + 1,
        num_decode_tokens=t,
    )
    return dev[:t], meta
