"""The engine core: scheduler + block manager + model runner, stepping token ids.

It knows nothing of text: requests arrive as token ids and leave as new token ids per
step. Tokenizing, detokenizing and stop strings belong to the caller (``LLMEngine``
in-process, ``AsyncLLM`` across a process boundary), which aborts a request whose text
hit a stop string.
"""

from __future__ import annotations

import logging
import time

from atom.config import Config
from atom.core_types import RunnerOutput, SchedulerOutput
from atom.distributed.dp_attention import Lockstep, init_dp_attention
from atom.engine.block_manager import BlockManager
from atom.engine.constrained_requests import ConstrainedRequests
from atom.engine.outputs import CoreInfo, EngineCoreOutput, EngineCoreRequest, EngineStats
from atom.engine.scheduler import Scheduler
from atom.engine.sequence import Sequence
from atom.engine.step_trace import StepTrace
from atom.worker.model_runner import ModelRunner, PendingOutput
from atom.worker.rank_worker import ParallelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: Config):
        self.config = config
        # one rank runs in this process; more run in their own processes (ParallelRunner)
        tp = config.parallel_config.tensor_parallel_size
        # data-parallel attention: this replica meets the others in every MoE layer
        self.lockstep: Lockstep | None = None
        if config.parallel_config.enable_dp_attention:
            rank, self.lockstep = init_dp_attention(config)
            self.runner: ModelRunner | ParallelRunner = ModelRunner(config, rank)
        else:
            self.runner = ModelRunner(config) if tp == 1 else ParallelRunner(config)
        num_blocks = self.runner.determine_num_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.warmup()
        self.runner.capture_cudagraphs()
        self.block_manager = BlockManager(num_blocks, config.cache_config.block_size,
                                          config.cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config, self.block_manager, config.model_config.max_model_len,
                                   config.speculative_config.num_lookahead)
        self.requests: dict[str, Sequence] = {}
        self._in_flight: tuple[SchedulerOutput, PendingOutput] | None = None  # async scheduling
        self.trace = StepTrace.from_env()  # ATOM_STEP_TRACE: a per-step timeline
        self.constrained = ConstrainedRequests(config)  # structured output
        self.ran_forward = False  # whether the last step() launched a forward

    def info(self) -> CoreInfo:
        bm = self.block_manager
        return CoreInfo(bm.num_blocks, bm.block_size, self.scheduler.max_seq_len, bm.capacity)

    def add_request(self, req: EngineCoreRequest) -> int:
        """Queue a request; returns the data-parallel replica that runs it: 0, this core (the
        ``-dp`` client's ``add_request`` returns its choice)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if not req.prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.config.model_config.hf_config.vocab_size
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:10]}")
        req.sampling_params.check_token_ids(vocab)
        seq = Sequence(req.request_id, req.prompt_token_ids, req.sampling_params, req.eos_token_ids,
                       req.arrival_time)
        self.scheduler.check_fits(seq)  # raises ValueError if it can never fit
        if self.constrained.wants(seq):
            self.constrained.add(seq)  # scheduled once its grammar is compiled
        else:
            self.scheduler.add(seq)
        self.requests[req.request_id] = seq
        if self.trace:
            self.trace.arrive()
        return 0

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            seq = self.requests.pop(rid, None)
            if seq is None:
                continue
            compiling = rid in self.constrained.compiling
            self.constrained.remove(rid)
            if not compiling and not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                self.runner.release(rid)

    def has_unfinished_requests(self) -> bool:
        if self.scheduler.has_unfinished() or self.constrained.compiling:
            return True
        # a step in flight whose requests were all aborted has nothing left to deliver
        return self._in_flight is not None and any(s.request_id in self.requests for s in self._in_flight[0].requests)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and launch a step, then collect the outputs of the step launched before
        it (async scheduling: the device runs one step while the host prepares the next)
        or of this one. A request whose logits processing reads its sampled tokens
        (penalties, min_tokens, bad_words) needs the step in flight collected before the
        next is scheduled: that step runs synchronously."""
        outputs = self._admit_constrained()
        if self._in_flight is not None and any(s.sampling_params.uses_history for s in self._in_flight[0].requests):
            outputs += self._collect(*self._in_flight)
            self._in_flight = None
        trace = self.trace
        if trace:
            trace.mark("begin")
        batch = self.constrained.attach_bitmask(self.scheduler.schedule())
        if trace:
            trace.mark("scheduled")
            start = trace.device_begin()
        launched = (batch, self.runner.launch(batch)) if not batch.is_empty else None
        self.ran_forward = launched is not None
        if trace and launched:
            trace.launched(batch, start, len(self.scheduler.waiting), len(self.scheduler.running))
        if launched is None and self._in_flight is None and self.constrained.compiling:
            self.constrained.wait()  # nothing else to run: do not spin while grammars compile
        # speculative steps run synchronously
        if not self.config.scheduler_config.async_scheduling or self.scheduler.num_lookahead:
            return outputs + (self._collect(*launched) if launched else [])
        previous, self._in_flight = self._in_flight, launched
        return outputs + (self._collect(*previous) if previous else [])

    def _admit_constrained(self) -> list[EngineCoreOutput]:
        """Schedule the requests whose grammar is compiled; fail those whose grammar failed."""
        ready, failed = self.constrained.take_ready()
        for seq in ready:
            self.scheduler.add(seq)
        for seq in failed:
            self.requests.pop(seq.request_id, None)
            seq.finish_reason = "error"
        return [EngineCoreOutput(request_id=s.request_id, new_token_ids=[], finish_reason="error", error=s.error)
                for s in failed]

    def _advance_grammars(self, batch: SchedulerOutput, sampled: dict[int, list[int]]) -> None:
        """Feed each constrained request its sampled tokens; one that breaks its grammar
        (which the mask should make impossible) finishes with an error."""
        for i, tokens in list(sampled.items()):
            seq = batch.requests[i]
            if not self.constrained.wants(seq):
                continue
            bad = next((t for t in tokens if not self.constrained.accept(seq, t)), None)
            if bad is not None:
                seq.error = f"token {bad} does not match the request's structured output grammar"
                if not seq.is_finished:
                    self.scheduler.finish(seq, "error")
                else:
                    seq.finish_reason = "error"

    def _collect(self, batch: SchedulerOutput, pending: PendingOutput) -> list[EngineCoreOutput]:
        if self.trace:
            self.trace.mark("wait")
        result: RunnerOutput = pending.result()
        if self.trace:
            self.trace.mark("ready")
        sampled = self.scheduler.collect(batch, result)
        self._advance_grammars(batch, sampled)
        outputs = []
        for i, seq in enumerate(batch.requests):
            if self.requests.get(seq.request_id) is not seq:
                continue  # aborted while the step ran, or finished by an earlier step
            failed = seq.finish_reason == "error"
            if i not in sampled and not failed and (seq.is_finished or i not in result.prompt_logprobs):
                continue  # nothing new
            prompt_lps = result.prompt_logprobs.get(i)
            outputs.append(EngineCoreOutput(
                request_id=seq.request_id,
                new_token_ids=sampled.get(i, []),
                finish_reason=seq.finish_reason,
                new_logprobs=[result.logprobs[i]] if i in result.logprobs else [],
                prompt_logprobs=self.scheduler.new_prompt_logprobs(seq, batch.starts[i], prompt_lps)
                if prompt_lps is not None and not failed else [],
                num_cached_tokens=seq.num_cached_tokens,
                error=seq.error,
            ))
            if seq.is_finished:
                self.requests.pop(seq.request_id, None)
                self.runner.release(seq.request_id)
                self.constrained.remove(seq.request_id)
        if self.trace:
            m = self.trace.marks
            self.trace.collected((m["ready"] - m["wait"]) * 1000, (time.perf_counter() - m["ready"]) * 1000)
        return outputs

    # utilities (the engine-core process calls them by name)
    def start_profile(self) -> None:
        self.runner.start_profile()

    def stop_profile(self) -> None:
        self.runner.stop_profile()

    @property
    def profiling(self) -> bool:
        return self.runner.profiler is not None

    def shutdown(self) -> None:
        """Stop the rank processes (tensor parallelism); the in-process runner needs nothing."""
        if self.trace:
            self.trace.flush()
        if isinstance(self.runner, ParallelRunner):
            self.runner.shutdown()

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
            spec=self.scheduler.spec_stats.snapshot() if self.scheduler.num_lookahead else None,
        )
