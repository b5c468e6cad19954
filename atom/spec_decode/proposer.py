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
    decode_rows: bool = False,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, metadata) of rows whose queries are ``lengths[i]`` tokens from position
    ``starts[i]``. With ``decode_rows`` (a handful of tokens a row: a verify step's kept
    tokens, a draft step's one) every token is a decode row over its causal prefix, so the
    draft runs the decode kernels and its CUDA graphs; otherwise each row is one query (a prompt
    chunk the draft reads takes the prefill path, whose keys it reads once). A position past
    the row's allocated slots or the model length (a draft that could never be verified) is
    clamped to the last one and writes no KV."""
    pos, slots, cu, seq_lens, token_rows = [], [], [0], [], []
    for i, (seq, start, n) in enumerate(zip(requests, starts, lengths)):
        table = seq.block_table
        limit = min(len(table) * block_size, max_model_len)
        for p in range(start, start + n):
            inside = p < limit
            p = p if inside else limit - 1
            pos.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size if inside else -1)
        cu.append(cu[-1] + n)
        seq_lens.append(min(start + n, limit))
        token_rows += [i] * n
    width = max(len(s.block_table) for s in requests)
    tables = np.zeros((len(requests), width), dtype=np.int64)
    for i, seq in enumerate(requests):
        tables[i, : len(seq.block_table)] = seq.block_table
    t = len(pos)
    if decode_rows:
        cu, seq_lens = list(range(t + 1)), [p + 1 for p in pos]
    else:
        token_rows = []
    # one host-to-device copy: positions | slots | cu_seqlens | seq_lens | token rows | block tables
    parts = [pos, slots, cu, seq_lens, token_rows, tables.reshape(-1)]
    dev = to_device(np.concatenate([np.asarray(x, dtype=np.int64) for x in parts]), torch.int64, device)
    offsets = np.cumsum([0] + [len(x) for x in parts])
    field = [dev[a:b] for a, b in zip(offsets, offsets[1:])]
    block_tables = field[5].view(len(requests), width).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=field[1],
        cu_seqlens_q=field[2].to(torch.int32),
        seq_lens=field[3].to(torch.int32),
        # a decode row reads its request's table, repeated on the device (tables can be long)
        block_tables=block_tables[field[4]] if decode_rows else block_tables,
        max_seqlen_q=1 if decode_rows else max(lengths),
        max_seqlen_k=max(seq_lens),
        num_decode_tokens=t if decode_rows else (len(requests) if all(n == 1 for n in lengths) else 0),
        cu_seqlens_q_cpu=cu,
        seq_lens_cpu=seq_lens,
    )
    return field[0], meta
