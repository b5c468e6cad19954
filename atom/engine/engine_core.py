"""The engine core: scheduler + block manager + model runner, stepping token ids.

It knows nothing of text: requests arrive as token ids and leave as new token ids per
step. Tokenizing, detokenizing and stop strings belong to the caller (``LLMEngine``
in-process, ``AsyncLLM`` across a process boundary), which aborts a request whose text
hit a stop string.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from atom.config import Config
from atom.engine.block_manager import BlockManager
from atom.engine.scheduler import ScheduledBatch, Scheduler
from atom.engine.sequence import Sequence
from atom.sampling_params import SamplingParams
from atom.worker.logprobs import TokenLogprobs
from atom.worker.model_runner import ModelRunner, PendingOutput

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.time)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class EngineCore:
    def __init__(self, config: Config):
        self.config = config
        self.runner = ModelRunner(config)
        num_blocks = self.runner.determine_num_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.warmup()
        self.runner.capture_cudagraphs()
        self.block_manager = BlockManager(num_blocks, config.cache_config.block_size,
                                          config.cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config, self.block_manager)
        self.requests: dict[str, Sequence] = {}
        self._in_flight: tuple[ScheduledBatch, PendingOutput] | None = None  # async scheduling

    def add_request(self, req: EngineCoreRequest) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if not req.prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.config.model_config.hf_config.vocab_size
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:10]}")
        seq = Sequence(req.request_id, req.prompt_token_ids, req.sampling_params, req.eos_token_ids,
                       req.arrival_time)
        self.scheduler.add(seq)  # raises ValueError if it can never fit
        self.requests[req.request_id] = seq

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            seq = self.requests.pop(rid, None)
            if seq is not None and not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                self.runner.release(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and launch a step, then collect the outputs of the step launched before
        it (async scheduling: the device runs one step while the host prepares the next)
        or of this one."""
        batch = self.scheduler.schedule()
        launched = (batch, self.runner.launch(batch)) if batch.seqs else None
        if not self.config.scheduler_config.async_scheduling:
            return self._collect(*launched) if launched else []
        previous, self._in_flight = self._in_flight, launched
        return self._collect(*previous) if previous else []

    def _collect(self, batch: ScheduledBatch, pending: PendingOutput) -> list[EngineCoreOutput]:
        result = pending.result()
        sampled = self.scheduler.collect(batch, result.sampled)
        outputs = []
        for i, seq in enumerate(batch.seqs):
            if i not in sampled and (seq.is_finished or i not in result.prompt_logprobs):
                continue  # nothing new, or aborted while the step ran
            outputs.append(EngineCoreOutput(
                request_id=seq.request_id,
                new_token_ids=[sampled[i]] if i in sampled else [],
                finish_reason=seq.finish_reason,
                new_logprobs=[result.logprobs[i]] if i in result.logprobs else [],
                prompt_logprobs=result.prompt_logprobs.get(i, []),
                num_cached_tokens=seq.num_cached_tokens,
            ))
            if seq.is_finished:
                self.requests.pop(seq.request_id, None)
                self.runner.release(seq.request_id)
        return outputs

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage,
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=bm.num_prefix_queries,
            prefix_cache_hits=bm.num_prefix_hits,
        )
