"""Logit penalties and masks applied before temperature, as vLLM's sampler does, batched.

Per row, in vLLM's order: tokens outside ``allowed_bitmask`` go to -inf; the sparse
entries add their value (``logit_bias``, and -inf for the stop ids of a request still below
``min_tokens`` and for the last token of a bad word whose prefix ends the output); then
the repetition penalty divides a positive logit (multiplies a negative one) by ``repetition``
for every token seen in the prompt or the output; the frequency penalty subtracts
``frequency * count`` and the presence penalty ``presence`` for every token of the output.

Neutral values: presence 0, frequency 0, repetition 1. The masks commute with the additions
(-inf plus a finite bias stays -inf), so a kernel may apply them in any order; the sparse
values must be finite or -inf.
"""

from __future__ import annotations

import torch


def token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-row counts [B, vocab] int32 of ``tokens`` [B, L] (int64, padded with ``vocab_size``)."""
    counts = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.int32, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.int32))
    return counts[:, :vocab_size]


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [B, vocab] from an int32 bitmask [B, ceil(vocab / 32)] (bit j of word w is token
    32 w + j: xgrammar's layout)."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    return ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab_size]


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """The int32 bitmask [B, ceil(V / 32)] of a bool [B, V] (the inverse of ``unpack_bitmask``)."""
    rows, vocab = allowed.shape
    padded = torch.zeros(rows, -(-vocab // 32) * 32, dtype=torch.int64, device=allowed.device)
    padded[:, :vocab] = allowed
    words = (padded.view(rows, -1, 32) << torch.arange(32, device=allowed.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # as int32 bit patterns


def apply_penalties(
    logits: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
    prompt_counts: torch.Tensor | None,
    output_counts: torch.Tensor | None,
    allowed_bitmask: torch.Tensor | None,
    sparse_rows: torch.Tensor | None,
    sparse_tokens: torch.Tensor | None,
    sparse_values: torch.Tensor | None,
) -> torch.Tensor:
    """Return penalised float32 logits [B, V] (a new tensor).

    ``presence``/``frequency``/``repetition``: float32 [B]. ``prompt_counts``,
    ``output_counts``: int [B, V] token counts (None: no row has a penalty). ``allowed_bitmask``:
    int32 [B, ceil(V / 32)], a set bit allows the token (None: all allowed). ``sparse_*``:
    parallel 1-D tensors (row, token, value) added to the logits; a (row, token) may repeat.
    """
    logits = logits.float().clone()
    if allowed_bitmask is not None:
        logits.masked_fill_(~unpack_bitmask(allowed_bitmask, logits.shape[1]), float("-inf"))
    if sparse_rows is not None and sparse_rows.numel():
        logits.index_put_((sparse_rows.long(), sparse_tokens.long()), sparse_values.float(), accumulate=True)
    if output_counts is None:
        return logits
    seen = (prompt_counts > 0) | (output_counts > 0)
    scale = torch.where(seen, repetition[:, None], 1.0)
    # vLLM multiplies by the reciprocal rather than dividing; same here, bit for bit
    logits *= torch.where(logits > 0, 1.0 / scale, scale)
    logits -= frequency[:, None] * output_counts
    logits -= presence[:, None] * (output_counts > 0)
    return logits
