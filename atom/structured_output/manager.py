"""The engine's side of structured output: each constrained request's grammar (compiling,
ready or failed), its matcher, and the batch's bitmask in the scheduled order.

The scheduler adds a request when it arrives (compilation starts on the compiler's thread),
skips it while ``is_ready`` is False, finishes it with an error if ``error`` is set; each
step the runner asks for ``grammar_bitmask`` of the scheduled requests and, after
sampling, reports the tokens with ``accept_tokens``. With a reasoning model the grammar
starts after the reasoning-end token (``</think>``): the reasoning itself is free.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from atom.structured_output import bitmask
from atom.structured_output.compiler import GrammarCompiler
from atom.structured_output.matcher import GrammarState
from atom.structured_output.spec import GrammarSpec


@dataclass(slots=True)
class _Request:
    future: Future
    stop_token_ids: Sequence[int] | None
    reasoning: bool  # still before the reasoning-end token
    state: GrammarState | None = None


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler, max_num_seqs: int, reasoning_end_token_id: int | None = None):
        self.compiler = compiler
        self._reasoning_end = reasoning_end_token_id
        self._requests: dict[str, _Request] = {}
        self._bitmask = bitmask.allocate(max_num_seqs, compiler.vocab_size)

    def add_request(
        self, request_id: str, spec: GrammarSpec, stop_token_ids: Sequence[int] | None = None, reasoning: bool = False
    ) -> None:
        """Start compiling. ``reasoning``: the output begins with reasoning the grammar must
        not constrain (needs the manager's ``reasoning_end_token_id``)."""
        reasoning = reasoning and self._reasoning_end is not None
        self._requests[request_id] = _Request(self.compiler.submit(spec), stop_token_ids, reasoning)

    def is_ready(self, request_id: str) -> bool:
        """False while the grammar compiles; True once it is ready or has failed (see ``error``)."""
        return self._requests[request_id].future.done()

    def error(self, request_id: str) -> str | None:
        request = self._requests[request_id]
        failure = request.future.exception() if request.future.done() else None
        return str(failure) if failure is not None else None

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def _state(self, request_id: str | None) -> GrammarState | None:
        request = self._requests.get(request_id) if request_id is not None else None
        if request is None or request.reasoning:
            return None
        if request.state is None:
            request.state = GrammarState(request.future.result(), request.stop_token_ids)
        return request.state

    def grammar_bitmask(self, request_ids: Sequence[str | None]) -> torch.Tensor | None:
        """The bitmask of the batch (row i for ``request_ids[i]``; None or an unconstrained id
        allows everything), or None when no row is constrained. Every constrained request
        must be ready. The tensor is reused by the next call."""
        states = [self._state(rid) for rid in request_ids]
        if not any(states):
            return None
        bitmask.fill(self._bitmask, states)
        return self._bitmask[: len(request_ids)]

    def accept_tokens(self, request_id: str, tokens: Sequence[int]) -> bool:
        """Advance over the request's new tokens; False if one breaks its grammar (a bug: the
        mask allowed it) — the caller should finish the request with an error."""
        request = self._requests.get(request_id)
        if request is None:
            return True
        if request.reasoning:
            if self._reasoning_end not in tokens:
                return True
            request.reasoning = False
            tokens = list(tokens)[list(tokens).index(self._reasoning_end) + 1 :]
        return self._state(request_id).accept(tokens)

    def is_terminated(self, request_id: str) -> bool:
        """The grammar is complete and a stop token was accepted."""
        request = self._requests.get(request_id)
        return request is not None and request.state is not None and request.state.is_terminated
