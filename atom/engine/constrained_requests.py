"""The engine core's requests with structured output: held back while their grammar
compiles (vLLM's WAITING_FOR_FSM), then scheduled like the others; each step the bitmask
of their sampled rows goes to the runner with the step, and their sampled tokens advance
their grammar.

The grammar compiler needs the tokenizer's vocabulary; the engine core loads it (from the
model config's tokenizer path) on a background thread when the first constrained request
arrives, so plain serving never pays for it and no step waits for it.
"""

from __future__ import annotations

import dataclasses
import logging

from atom.config import Config
from atom.core_types import SchedulerOutput
from atom.engine.arg_utils import load_tokenizer
from atom.engine.sequence import Sequence
from atom.structured_output import GrammarCompiler, GrammarSpec, StructuredOutputManager
from atom.structured_output.reasoning import prompt_ends_reasoning, reasoning_tag_ids

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # an engine with only compiling requests sleeps this long at most per step


class ConstrainedRequests:
    def __init__(self, config: Config):
        self.config = config
        self.compiling: dict[str, Sequence] = {}
        self._manager: StructuredOutputManager | None = None
        self._tag_ids: tuple[int, int] | None = None

    @staticmethod
    def wants(seq: Sequence) -> bool:
        return seq.sampling_params.structured_outputs is not None

    def add(self, seq: Sequence) -> None:
        """Start compiling the request's grammar; it waits in ``compiling`` meanwhile."""
        spec = GrammarSpec.from_params(seq.sampling_params.structured_outputs)
        manager = self._get_manager()
        stops = [*seq.eos_token_ids, *seq.sampling_params.stop_token_ids]
        manager.add_request(seq.request_id, spec, stop_token_ids=stops or None, reasoning=True)
        self.compiling[seq.request_id] = seq

    def take_ready(self) -> tuple[list[Sequence], list[Sequence]]:
        """The requests whose grammar is compiled (to schedule) and those whose grammar
        failed (``seq.error`` set; the caller finishes them), removed from ``compiling``."""
        ready, failed = [], []
        for rid, seq in list(self.compiling.items()):
            if not self._manager.is_ready(rid):
                continue
            del self.compiling[rid]
            error = self._manager.error(rid)
            if error is None:
                self._start_after_reasoning(seq)
                ready.append(seq)
            else:
                self._manager.remove_request(rid)
                seq.error = error
                failed.append(seq)
        return ready, failed

    def wait(self) -> None:
        """Nothing else to run: block until a grammar is ready (or a short while passes)."""
        self._manager.wait_any(list(self.compiling), IDLE_WAIT_S)

    def attach_bitmask(self, batch: SchedulerOutput) -> SchedulerOutput:
        """The batch with the grammar bitmask of its sampled rows (None if none is constrained)."""
        if self._manager is None:
            return batch
        rids = [
            seq.request_id if self.wants(seq) else None
            for seq, samples in zip(batch.requests, batch.samples)
            if samples
        ]
        if not any(rids):
            return batch
        mask = self._manager.grammar_bitmask(rids)
        if mask is None:
            return batch
        return dataclasses.replace(batch, grammar_bitmask=mask.clone())  # the manager reuses its buffer

    def accept(self, seq: Sequence, token: int) -> bool:
        """Advance the request's grammar over its sampled token; False if the token breaks
        it (the mask should have prevented that)."""
        return self._manager is None or self._manager.accept_tokens(seq.request_id, [token])

    def remove(self, request_id: str) -> None:
        self.compiling.pop(request_id, None)
        if self._manager is not None:
            self._manager.remove_request(request_id)

    def _start_after_reasoning(self, seq: Sequence) -> None:
        """A prompt that already closed the reasoning (thinking off) constrains from the start."""
        if self._tag_ids is not None and prompt_ends_reasoning(seq.token_ids[: seq.num_prompt_tokens], self._tag_ids):
            self._manager.end_reasoning(seq.request_id)

    def _get_manager(self) -> StructuredOutputManager:
        if self._manager is None:
            mc, sc = self.config.model_config, self.config.scheduler_config
            vocab = mc.hf_config.vocab_size  # the logits' width (padding included), not the tokenizer's
            self._manager = StructuredOutputManager(self._build_compiler, sc.max_num_seqs, vocab_size=vocab)
        return self._manager

    def _build_compiler(self) -> GrammarCompiler:
        mc = self.config.model_config
        tokenizer = load_tokenizer(mc.tokenizer, mc.trust_remote_code)
        self._tag_ids = reasoning_tag_ids(self.config.reasoning_parser, tokenizer)
        if self._tag_ids is not None:
            self._manager.set_reasoning_end(self._tag_ids[1])
        elif self.config.reasoning_parser is not None:
            logger.warning(
                "--reasoning-parser %s: the tokenizer has no single-token reasoning tags; structured "
                "output constrains the whole output",
                self.config.reasoning_parser,
            )
        compiler = GrammarCompiler(tokenizer, vocab_size=mc.hf_config.vocab_size)
        logger.info("structured output: grammar compiler ready (vocabulary of %d tokens)", compiler.vocab_size)
        return compiler
