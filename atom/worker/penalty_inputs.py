"""Per-request penalty parameters and token history -> the batched tensors of ``ops.apply_penalties``.

vLLM's semantics: presence and frequency penalties count the output tokens, the repetition
penalty the prompt and output tokens; a request below ``min_tokens`` output tokens cannot
sample its stop ids (EOS included); a bad word's last token is masked when the rest of the
word ends the output (a one-token bad word is always masked); ``allowed_token_ids`` masks
every other token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from atom.ops.penalties import pack_bitmask, token_counts


@dataclass(frozen=True, slots=True)
class RequestPenalties:
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    min_tokens: int = 0
    stop_token_ids: Sequence[int] = ()  # every id that ends the request, EOS included
    bad_words_token_ids: Sequence[Sequence[int]] = ()
    allowed_token_ids: Sequence[int] | None = None

    @property
    def has_penalty(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def masked_token_ids(self) -> list[int]:
        """Tokens this step may not sample: stop ids below min_tokens, completed bad words."""
        out = self.output_token_ids
        masked = list(self.stop_token_ids) if len(out) < self.min_tokens else []
        for word in self.bad_words_token_ids:
            prefix = list(word[:-1])  # compare with the output's tail only: no copy of the whole output
            if len(prefix) <= len(out) and (not prefix or list(out[len(out) - len(prefix) :]) == prefix):
                masked.append(word[-1])
        return masked


@dataclass(frozen=True, slots=True)
class PenaltyInputs:
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    prompt_counts: torch.Tensor | None
    output_counts: torch.Tensor | None
    allowed_bitmask: torch.Tensor | None
    sparse_rows: torch.Tensor | None
    sparse_tokens: torch.Tensor | None
    sparse_values: torch.Tensor | None

    def args(self) -> tuple:
        """The arguments after ``logits`` of ``ops.apply_penalties``."""
        return tuple(getattr(self, name) for name in self.__slots__)


def _padded(rows: list[Sequence[int]], pad: int) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=torch.int64)


def _allowed_bitmask(requests: Sequence[RequestPenalties], vocab_size: int) -> torch.Tensor:
    allowed = torch.ones(len(requests), vocab_size, dtype=torch.bool)
    for row, r in enumerate(requests):
        if r.allowed_token_ids is not None:
            allowed[row] = False
            allowed[row, list(r.allowed_token_ids)] = True
    return pack_bitmask(allowed)


def build_penalty_inputs(
    requests: Sequence[RequestPenalties],
    vocab_size: int,
    device: torch.device | str = "cpu",
    counts: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PenaltyInputs | None:
    """The batch's tensors on ``device``, or None when no request needs any of this.
    ``counts``: the (prompt, output) count rows of the batch kept by ``TokenCounts``; without
    them they are counted here from the requests' token lists."""
    sparse = [(row, tok, float("-inf")) for row, r in enumerate(requests) for tok in r.masked_token_ids()]
    sparse += [(row, tok, bias) for row, r in enumerate(requests) for tok, bias in (r.logit_bias or {}).items()]
    any_penalty = any(r.has_penalty for r in requests)
    any_allowed = any(r.allowed_token_ids is not None for r in requests)
    if not (sparse or any_penalty or any_allowed):
        return None

    def floats(values):
        return torch.tensor(values, dtype=torch.float32).to(device)

    prompt_counts = output_counts = None
    if any_penalty and counts is not None:
        prompt_counts, output_counts = counts
    elif any_penalty:
        # rows without penalties count nothing: their neutral values ignore the counts anyway
        prompts = [r.prompt_token_ids if r.has_penalty else () for r in requests]
        outputs = [r.output_token_ids if r.has_penalty else () for r in requests]
        prompt_counts = token_counts(_padded(prompts, vocab_size).to(device), vocab_size)
        output_counts = token_counts(_padded(outputs, vocab_size).to(device), vocab_size)
    rows, tokens, values = zip(*sparse) if sparse else ((), (), ())
    return PenaltyInputs(
        presence=floats([r.presence_penalty for r in requests]),
        frequency=floats([r.frequency_penalty for r in requests]),
        repetition=floats([r.repetition_penalty for r in requests]),
        prompt_counts=prompt_counts,
        output_counts=output_counts,
        allowed_bitmask=_allowed_bitmask(requests, vocab_size).to(device) if any_allowed else None,
        sparse_rows=torch.tensor(rows, dtype=torch.int64).to(device) if sparse else None,
        sparse_tokens=torch.tensor(tokens, dtype=torch.int64).to(device) if sparse else None,
        sparse_values=floats(values) if sparse else None,
    )


def bad_words_token_ids(tokenizer, bad_words: Sequence[str]) -> list[list[int]]:
    """vLLM's tokenization of ``bad_words``: each word alone and, when that gives a different
    first token of the same length, with a leading space (a word in the middle of text)."""
    ids: list[list[int]] = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words entry {word!r} tokenizes to no tokens")
        ids.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            ids.append(spaced)
    return ids
