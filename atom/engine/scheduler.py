"""Continuous batching, vLLM v1 style.

Every step hands each chosen sequence a number of new tokens to compute under one token
budget: a decode is 1 token, a prompt is as many as fit (chunked prefill), and both mix
in one batch. Running sequences go first; when KV blocks run out, the newest running
sequence is preempted (its blocks freed, recomputed later). Waiting sequences are admitted
in arrival order while budget, ``max_num_seqs`` and blocks allow.

Scheduling a step also books its effect: the scheduled tokens count as computed and a
sequence that samples gets a ``PLACEHOLDER`` token. ``collect`` later writes the sampled
ids in and retires finished sequences. With async scheduling the engine schedules (and
launches) step N+1 before collecting step N, so the host work of one step overlaps the
device work of the other; a sequence that step N finishes then wastes one row of N+1.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from atom.config import SchedulerConfig
from atom.engine.block_manager import BlockManager
from atom.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens to compute per sequence this step
    starts: list[int]  # computed tokens of each sequence before this step
    samples: list[bool]  # whether the sequence reaches its last token (and samples one)

    @classmethod
    def empty(cls) -> ScheduledBatch:
        return cls([], [], [], [])


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # KV capacity bounds the length a sequence may reach
        self.max_seq_len = min(config.max_model_len, block_manager.num_blocks * block_manager.block_size)
        self.num_preemptions = 0
        # scheduler_delay_factor bookkeeping (as vLLM's v0 scheduler)
        self._prev_time = 0.0
        self._prev_prompt = False
        self._last_prompt_latency = 0.0

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt has {seq.num_tokens} tokens but at most {self.max_seq_len} fit "
                f"(max_model_len={self.config.max_model_len}, KV cache holds "
                f"{self.block_manager.num_blocks * self.block_manager.block_size} tokens)"
            )
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        seqs, counts = [], []
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
            bm = self.block_manager
            needed = bm.blocks_needed(seq, n)
            while needed > bm.num_free_blocks:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                if needed:
                    bm.allocate(seq, n)
                seqs.append(seq)
                counts.append(n)
                budget -= n
                i += 1

        # waiting: no new admissions in a step that had to preempt
        if not preempted and self.waiting and self._passed_delay(time.monotonic()):
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                cached = self.block_manager.find_cached_prefix(seq) if seq.num_computed_tokens == 0 else []
                n = min(seq.num_tokens - len(cached) * self.block_manager.block_size, budget)
                if not self.block_manager.can_allocate(seq, n, cached):
                    break
                self.waiting.popleft()
                self.block_manager.allocate(seq, n, cached)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                seqs.append(seq)
                counts.append(n)
                budget -= n
                self._prev_prompt = True
        # decode rows first: the attention kernel launches them with their own tile shape
        order = sorted(range(len(seqs)), key=lambda i: counts[i] != 1)
        batch = ScheduledBatch.empty()
        for i in order:
            seq, n = seqs[i], counts[i]
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            batch.starts.append(seq.num_computed_tokens)
            samples = seq.num_computed_tokens + n == seq.num_tokens
            batch.samples.append(samples)
            seq.num_computed_tokens += n
            if samples:
                seq.append_token(PLACEHOLDER)
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
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

    def collect(self, batch: ScheduledBatch, sampled: dict[int, int]) -> dict[int, int]:
        """Write in a step's sampled tokens (``sampled``: batch index -> token), register
        newly full blocks in the prefix cache and retire finished sequences. Returns the
        tokens that count (not those of sequences finished or aborted in the meantime)."""
        kept = {}
        for i, seq in enumerate(batch.seqs):
            if seq.is_finished:
                continue
            if i in sampled:
                at = batch.starts[i] + batch.num_new_tokens[i]  # the placeholder's index
                seq.token_ids[at] = kept[i] = sampled[i]
                reason = seq.check_stop(self.max_seq_len, at + 1)
                if reason is not None:
                    del seq.token_ids[at + 1 :]  # a placeholder of a step already launched
                    self.finish(seq, reason)
                    continue
            if seq.status == SequenceStatus.RUNNING:
                real = seq.num_tokens - (seq.token_ids[-1] == PLACEHOLDER)
                self.block_manager.cache_full_blocks(seq, min(seq.num_computed_tokens, real))
        return kept

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
