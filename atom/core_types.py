"""The messages between the scheduler and the model runner (one step).

They live at the package root so that ``atom/worker/`` and ``atom/engine/`` both import
them without the worker importing the engine. ``SchedulerOutput`` says what runs this
step; ``RunnerOutput`` says what it produced. The runner reads requests through the
read-only ``ScheduledRequest`` view and never writes them: the scheduler is the one
writer of request state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import msgspec

from atom.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

# Stands for a sampled token that is still on the device (async scheduling): the step
# after it reads the real id from the device, and the engine writes it in when it arrives.
PLACEHOLDER = -1


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Logprob of one token and the top alternatives, as the OpenAI ``logprobs`` fields need."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # (token id, logprob), best first


class ScheduledRequest(Protocol):
    """What the runner may read of a scheduled request (the engine's ``Sequence``). The
    runner reads it by reference, in the step it was scheduled in, and never writes it."""

    request_id: str
    token_ids: list[int]  # may end with a PLACEHOLDER (async scheduling)
    block_table: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What runs this step. Row ``i`` computes tokens ``starts[i] .. starts[i] +
    num_new_tokens[i]`` of ``requests[i]`` into its ``block_table``; decode rows (one new
    token) come first. A row that ``samples`` reaches its request's last token: the
    scheduler has already appended a ``PLACEHOLDER`` for the token it will sample."""

    requests: list[ScheduledRequest]
    num_new_tokens: list[int]
    starts: list[int]  # computed tokens of each request before this step
    samples: list[bool]
    num_decodes: int = 0  # leading rows with one new token
    # structured output: int32 [rows that sample, ceil(vocab / 32)] on the host, one row per
    # sampling row in order (a set bit allows the token); None when no row is constrained
    grammar_bitmask: torch.Tensor | None = None
    # speculative decoding: row -> draft tokens that end its new tokens (they follow the
    # request's last sampled token and are verified by this step's forward)
    num_drafts: dict[int, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """What a step produced, by row of its ``SchedulerOutput``."""

    sampled: dict[int, int]  # row -> token id
    logprobs: dict[int, TokenLogprobs]  # rows that asked for logprobs
    # row -> logprobs of the prompt tokens ``starts[row] + 1 ..`` that the row's chunk predicts
    prompt_logprobs: dict[int, list[TokenLogprobs]]
    # row -> why this request failed (its own inputs, not the device): the engine finishes
    # it with finish_reason "error" and the other rows go on
    errors: dict[int, str]
    # speculative decoding: row -> draft tokens accepted, which come before ``sampled[row]``
    accepted: dict[int, list[int]] = field(default_factory=dict)
    # row -> draft tokens proposed to follow ``sampled[row]``, for the request's next step
    drafts: dict[int, list[int]] = field(default_factory=dict)
