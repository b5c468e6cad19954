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
    catching up with ``len(token_ids)``; the scheduler gives each step a slice of it."""

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
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hashes of the full blocks of block_table, in order
        self.num_preemptions = 0
        # prompt tokens whose logprobs were already returned (a recompute after preemption
        # must not return them again)
        self.num_prompt_logprobs_done = 1

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

    def check_stop(self, max_model_len: int) -> str | None:
        """Finish reason after the last appended token, or None to keep going."""
        params = self.sampling_params
        last = self.token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if last in params.stop_token_ids:
            return "stop"
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None
