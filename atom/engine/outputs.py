"""The engine core's public messages: requests in, token outputs and stats out.

``EngineCoreRequest`` and ``EngineCoreOutput`` are what ``LLMEngine`` and ``AsyncLLM`` see
of the core; the server imports its types from here (never from the worker). Across the
process boundary (``core_client`` <-> ``engine_core_proc``) every message is one of the
tagged, frozen msgspec Structs below, encoded with msgpack: ``ToCore`` one way, ``FromCore`` the
other. A receiver decodes into the union and dispatches on the type.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from atom.core_types import TokenLogprobs
from atom.sampling_params import SamplingParams
from atom.spec_decode.stats import SpecDecodeStats

__all__ = [
    "AbortRequests",
    "AddError",
    "CoreDead",
    "CoreInfo",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineStats",
    "FromCore",
    "Shutdown",
    "StatsUpdate",
    "ToCore",
    "TokenLogprobs",
    "UtilityCall",
    "UtilityReply",
]


class CoreInfo(msgspec.Struct, frozen=True):
    """What the core measured at start-up and its callers need for validation."""

    num_blocks: int
    block_size: int
    max_seq_len: int  # longest sequence that fits: min(max_model_len, KV capacity)
    kv_capacity: int  # tokens the KV cache holds


class EngineCoreRequest(msgspec.Struct, frozen=True, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = msgspec.field(default_factory=time.time)


class EngineCoreOutput(msgspec.Struct, frozen=True):
    """New tokens of one request from one step; ``finish_reason`` set on its last."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    new_logprobs: list[TokenLogprobs] = []
    prompt_logprobs: list[TokenLogprobs] = []
    num_cached_tokens: int = 0
    error: str | None = None  # with finish_reason "error": what failed, for the caller's 500

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineStats(msgspec.Struct, frozen=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec: SpecDecodeStats | None = None  # with speculative decoding


# to the core
class AbortRequests(msgspec.Struct, frozen=True, tag="abort"):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, frozen=True, tag="call"):
    call_id: int
    method: str  # "stats", "start_profile" or "stop_profile"
    args: list[Any] = []


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    pass


ToCore = EngineCoreRequest | AbortRequests | UtilityCall | Shutdown


# from the core
class EngineCoreOutputs(msgspec.Struct, frozen=True, tag="outputs"):
    outputs: list[EngineCoreOutput]
    stats: EngineStats


class StatsUpdate(msgspec.Struct, frozen=True, tag="stats"):
    stats: EngineStats


class AddError(msgspec.Struct, frozen=True, tag="add_error"):
    request_id: str
    message: str


class UtilityReply(msgspec.Struct, frozen=True, tag="reply"):
    call_id: int
    ok: bool
    result: EngineStats | str | None = None  # the error message when not ok


class CoreDead(msgspec.Struct, frozen=True, tag="dead"):
    message: str


FromCore = EngineCoreOutputs | StatsUpdate | AddError | UtilityReply | CoreDead
