"""Continuous batching, vLLM v1 style.

Every step hands each chosen sequence a number of new tokens to compute under one token
budget: a decode is 1 token, a prompt is as many as fit (chunked prefill), and both mix
in one batch. Running sequences go first; when KV blocks run out, the newest running
sequence is preempted (its blocks freed, recomputed later). Waiting sequences are admitted
in arrival order while budget, ``max_num_seqs`` and blocks allow.

Scheduling a step also books its effect: the scheduled tokens count as computed and a
sequence that samples gets a ``PLACEHOLDER`` token. ``collect`` later writes the sampled
ids (a ``RunnerOutput``) in and retires finished sequences. The scheduler is the one
writer of sequence state; a failure while collecting one sequence finishes only that one
(finish_reason "error"). With async scheduling the engine schedules (and
launches) step N+1 before collecting step N, so the host work of one step overlaps the
device work of the other; a sequence that step N finishes then wastes one row of N+1.

Speculative decoding (``atom/spec_decode``): a decode row also carries its request's draft
tokens, and every sampling row gets KV slots for the draft model's lookahead; ``collect``
keeps the accepted drafts and rolls ``num_computed_tokens`` back over the rejected ones.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from atom.config import SchedulerConfig
from atom.core_types import PLACEHOLDER, RunnerOutput, SchedulerOutput, TokenLogprobs
from atom.engine.block_manager import BlockManager
from atom.engine.sequence import Sequence, SequenceStatus
from atom.spec_decode.scheduling import num_drafts_to_verify, roll_back_drafts
from atom.spec_decode.stats import SpecStats

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 num_lookahead: int = 0):
        """``num_lookahead``: draft tokens per step of speculative decoding (0: off)."""
        self.config = config
        self.num_lookahead = num_lookahead
        self.spec_stats = SpecStats(num_lookahead)
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # KV capacity bounds the length a sequence may reach
        self.max_seq_len = min(max_model_len, block_manager.capacity)
        self.num_preemptions = 0
        # scheduler_delay_factor bookkeeping (as vLLM's v0 scheduler)
        self._prev_time = 0.0
        self._prev_prompt = False
        self._last_prompt_latency = 0.0

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        self.waiting.append(seq)

    def check_fits(self, seq: Sequence) -> None:
        """ValueError if the sequence can never fit."""
        if seq.num_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt has {seq.num_tokens} tokens but at most {self.max_seq_len} fit "
                f"(max_model_len={self.max_model_len}, KV cache holds "
                f"{self.block_manager.capacity} tokens)"
            )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        seqs, counts, drafts = [], [], {}
        budget = self.config.max_num_batched_tokens
        preempted = False

        # running
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.reached_length(self.max_seq_len):  # its last token is in flight
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            d = num_drafts_to_verify(seq, n, budget, self.max_seq_len) if self.num_lookahead else 0
            n += d
            bm = self.block_manager
            needed = bm.blocks_needed(seq, n + self._lookahead(seq.num_computed_tokens + n, seq.num_tokens + d))
            while needed > bm.num_free_blocks:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                if needed:
                    bm.allocate(seq, n + self._lookahead(seq.num_computed_tokens + n, seq.num_tokens + d))
                if d:
                    drafts[len(seqs)] = d
                seqs.append(seq)
                counts.append(n)
                budget -= n
                i += 1

        # waiting: no new admissions in a step that had to preempt
        if not preempted and self.waiting and self._passed_delay(time.monotonic()):
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                cached = self.block_manager.find_cached_prefix(seq) if seq.num_computed_tokens == 0 else []
                n = seq.num_tokens - len(cached) * self.block_manager.block_size
                if n > budget and not self.config.enable_chunked_prefill:
                    break  # scheduled whole or not at all (it fits an empty step: max_model_len)
                n = min(n, budget)
                slots = n + self._lookahead(len(cached) * self.block_manager.block_size + n, seq.num_tokens)
                if not self.block_manager.can_allocate(seq, slots, cached):
                    break
                self.waiting.popleft()
                self.block_manager.allocate(seq, slots, cached)
                if cached:
                    seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * self.block_manager.block_size
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                seqs.append(seq)
                counts.append(n)
                budget -= n
                self._prev_prompt = True
        # decode rows first: the attention kernel launches them with their own tile shape
        order = sorted(range(len(seqs)), key=lambda i: counts[i] != 1)
        requests, num_new, starts, samples, num_drafts = [], [], [], [], {}
        for i in order:
            seq, n = seqs[i], counts[i]
            if i in drafts:  # they follow the last sampled token, as tokens to verify
                num_drafts[len(requests)] = drafts[i]
                seq.token_ids.extend(seq.spec_token_ids[: drafts[i]])
            seq.spec_token_ids = []
            requests.append(seq)
            num_new.append(n)
            starts.append(seq.num_computed_tokens)
            last = seq.num_computed_tokens + n == seq.num_tokens
            samples.append(last)
            seq.num_computed_tokens += n
            if last:
                seq.append_token(PLACEHOLDER)
        return SchedulerOutput(requests, num_new, starts, samples, sum(1 for n in counts if n == 1),
                               num_drafts=num_drafts)

    def _lookahead(self, computed: int, num_tokens: int) -> int:
        """KV slots past a row's ``computed`` tokens that the draft model writes when the row
        samples (speculative decoding)."""
        if not self.num_lookahead or computed < num_tokens:
            return 0
        return max(0, min(self.num_lookahead, self.max_seq_len - computed))

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _passed_delay(self, now: float) -> bool:
        if self._prev_prompt:
            self._last_prompt_latency = now - self._prev_time
        self._prev_time, self._prev_prompt = now, False
        if self.config.scheduler_delay_factor <= 0 or not self.running:
            return True
        earliest = min(s.arrival_time for s in self.waiting)
        return (time.time() - earliest) > self.config.scheduler_delay_factor * self._last_prompt_latency

    def collect(self, batch: SchedulerOutput, out: RunnerOutput) -> dict[int, list[int]]:
        """Write in a step's sampled tokens, register newly full blocks in the prefix cache
        and retire finished sequences. Returns the tokens that count (row -> tokens; not
        those of sequences finished or aborted in the meantime). A row that failed, in the
        runner or here, finishes its sequence with finish_reason "error". With speculative
        decoding a row keeps several tokens: its accepted drafts, then the sampled one."""
        kept = {}
        for i, seq in enumerate(batch.requests):
            if seq.is_finished:
                continue
            error = out.errors.get(i)
            if error is None:
                try:
                    end = batch.starts[i] + batch.num_new_tokens[i]
                    if i in batch.num_drafts:
                        kept[i] = out.accepted.get(i, [])
                        end = roll_back_drafts(seq, end, batch.num_drafts[i], kept[i])
                        self.spec_stats.observe(batch.num_drafts[i], len(kept[i]))
                    self._collect_row(seq, end, out.sampled.get(i), kept, i)
                    if not seq.is_finished:
                        seq.spec_token_ids = out.drafts.get(i, [])
                    continue
                except Exception as e:  # this request's own failure: the others go on
                    logger.exception("request %s failed while collecting its step", seq.request_id)
                    error = f"{type(e).__name__}: {e}"
            kept.pop(i, None)
            seq.error = error
            self.finish(seq, "error")
        return kept

    def _collect_row(self, seq: Sequence, end: int, token: int | None, kept: dict[int, list[int]], i: int) -> None:
        """``end``: the index of the placeholder; accepted drafts (``kept[i]``) lie before it."""
        first = end - len(kept.pop(i, ()))
        if token is not None:
            seq.token_ids[end] = token  # the placeholder's index is ``end``
        if seq.status == SequenceStatus.RUNNING:  # (before finishing: a one-step request's prompt counts)
            real = seq.num_tokens - (seq.token_ids[-1] == PLACEHOLDER)
            self.block_manager.cache_full_blocks(seq, min(seq.num_computed_tokens, real))
        if token is None:
            return
        for j in range(first, end + 1):  # a stop inside an accepted run ends it there
            reason = seq.check_stop(self.max_seq_len, j + 1)
            if reason is not None or j == end:
                kept[i] = seq.token_ids[first : j + 1]
            if reason is not None:
                del seq.token_ids[j + 1 :]  # (also a placeholder of a step already launched)
                self.finish(seq, reason)
                return

    def new_prompt_logprobs(self, seq: Sequence, start: int, logprobs: list[TokenLogprobs]) -> list[TokenLogprobs]:
        """Of the prompt logprobs a chunk starting at ``start`` produced, those not returned
        before (a recompute after preemption repeats them)."""
        skip = max(0, seq.num_prompt_logprobs_done - (start + 1))
        seq.num_prompt_logprobs_done = max(seq.num_prompt_logprobs_done, start + 1 + len(logprobs))
        return logprobs[skip:]

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
