"""One request inside the engine core: its tokens and how many of them are computed."""

from __future__ import annotations

import time
from enum import Enum, auto

from atom.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """vLLM v1 style: there is no prefill or decode phase, only ``num_computed_tokens``
    catching up with ``len(token_ids)``; the scheduler gives each step a slice of it.
    The scheduler (with its block manager) is the only writer of this state; the model
    runner reads it as a ``ScheduledRequest``."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
    ):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it finished with finish_reason "error"
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hashes of the full blocks of block_table, in order
        # prompt tokens whose logprobs were already returned (a recompute after preemption
        # must not return them again)
        self.num_prompt_logprobs_done = 1
        # speculative decoding: draft tokens proposed to follow the last token, verified by
        # the request's next decode step
        self.spec_token_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def reached_length(self, max_model_len: int, num_tokens: int | None = None) -> bool:
        """Whether the first ``num_tokens`` tokens (default: all) use up max_tokens or the
        model length, so that no token may follow them."""
        n = self.num_tokens if num_tokens is None else num_tokens
        return n - self.num_prompt_tokens >= self.sampling_params.max_tokens or n >= max_model_len

    def check_stop(self, max_model_len: int, num_tokens: int | None = None) -> str | None:
        """Finish reason after the token at ``num_tokens - 1`` (default: the last), or None."""
        n = self.num_tokens if num_tokens is None else num_tokens
        params, token = self.sampling_params, self.token_ids[n - 1]
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            return "stop"
        return "length" if self.reached_length(max_model_len, n) else None
