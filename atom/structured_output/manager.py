"""The engine's side of structured output: each constrained request's grammar (compiling,
ready or failed), its matcher, and the batch's bitmask in the scheduled order.

The engine core adds a request when it arrives (compilation starts on the compiler's
thread), holds it back while ``is_ready`` is False, finishes it with an error if ``error``
is set; each step it asks for ``grammar_bitmask`` of the sampled rows (shipped to the runner
with the step) and, after sampling, reports the tokens with ``accept_tokens``. With a
reasoning model the grammar starts after the reasoning-end token (``</think>``): the
reasoning itself is free.

The compiler needs the tokenizer's vocabulary, which the engine core does not load for
plain requests: given a factory instead of a compiler, the manager builds it on its own
thread when the first constrained request arrives, so neither start-up nor a step waits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
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
    def __init__(
        self,
        compiler: GrammarCompiler | Callable[[], GrammarCompiler],
        max_num_seqs: int,
        reasoning_end_token_id: int | None = None,
        vocab_size: int | None = None,
    ):
        """``compiler``: one, or a factory (then ``vocab_size``, the logits width, is needed)."""
        self._compiler: Future[GrammarCompiler] = Future()
        self._factory = None
        if isinstance(compiler, GrammarCompiler):
            self._compiler.set_result(compiler)
            vocab_size = compiler.vocab_size
        else:
            self._factory = compiler
        self._reasoning_end = reasoning_end_token_id
        self._requests: dict[str, _Request] = {}
        self._bitmask = bitmask.allocate(max_num_seqs, vocab_size)

    @property
    def compiler(self) -> GrammarCompiler:
        """The compiler (waits for it to be built)."""
        return self._compiler.result()

    def _start_compiler(self) -> None:
        if self._factory is not None:
            factory, self._factory = self._factory, None
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atom-grammar-init")
            _chain(pool.submit(factory), self._compiler)
            pool.shutdown(wait=False)

    def add_request(
        self, request_id: str, spec: GrammarSpec, stop_token_ids: Sequence[int] | None = None, reasoning: bool = False
    ) -> None:
        """Start compiling. ``reasoning``: the output begins with reasoning the grammar must
        not constrain (needs the manager's ``reasoning_end_token_id``)."""
        self._start_compiler()
        grammar: Future = Future()
        self._compiler.add_done_callback(lambda built: _compile_when_built(built, spec, grammar))
        self._requests[request_id] = _Request(grammar, stop_token_ids, reasoning)

    def wait_any(self, request_ids: Sequence[str], timeout_s: float) -> None:
        """Block until one of these requests' grammars is ready (or ``timeout_s`` passes):
        what an engine with nothing else to run does instead of spinning."""
        futures = [self._requests[rid].future for rid in request_ids if rid in self._requests]
        wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def set_reasoning_end(self, token_id: int | None) -> None:
        """The reasoning-end token (known once the tokenizer is loaded); None: no reasoning."""
        self._reasoning_end = token_id

    def end_reasoning(self, request_id: str) -> None:
        """The request's reasoning is over already (its prompt closed it): constrain from now."""
        self._requests[request_id].reasoning = False

    def _reasoning(self, request: _Request) -> bool:
        return request.reasoning and self._reasoning_end is not None

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
        if request is None or self._reasoning(request):
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
        if self._reasoning(request):
            if self._reasoning_end not in tokens:
                return True
            request.reasoning = False
            tokens = list(tokens)[list(tokens).index(self._reasoning_end) + 1 :]
        return self._state(request_id).accept(tokens)

    def is_terminated(self, request_id: str) -> bool:
        """The grammar is complete and a stop token was accepted."""
        request = self._requests.get(request_id)
        return request is not None and request.state is not None and request.state.is_terminated


def _chain(source: Future, target: Future) -> None:
    """Complete ``target`` as ``source`` completes."""

    def copy(done: Future) -> None:
        error = done.exception()
        if error is not None:
            target.set_exception(error)
        else:
            target.set_result(done.result())

    source.add_done_callback(copy)


def _compile_when_built(built: Future, spec: GrammarSpec, grammar: Future) -> None:
    error = built.exception()
    if error is not None:
        grammar.set_exception(ValueError(f"structured output is unavailable: {error}"))
        return
    _chain(built.result().submit(spec), grammar)
