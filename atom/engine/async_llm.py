"""``AsyncLLM``: the engine as the API process sees it.

Tokenizing, detokenizing and stop strings happen here (``RequestState``, shared with
``LLMEngine``); the token work happens in the engine core process. Each request owns an
asyncio queue that the reader task fills; ``generate`` drains it. A consumer that stops
early (a client that disconnects, a cancelled task) aborts its request in the core, which
frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from atom.config import Config
from atom.engine.arg_utils import EngineArgs, eos_token_ids
from atom.engine.core_client import AsyncEngineCoreClient, CoreInfo, EngineDeadError
from atom.engine.llm_engine import load_tokenizer
from atom.engine.output_processor import RequestOutput, RequestState
from atom.engine.outputs import EngineCoreOutput, EngineCoreRequest, EngineStats
from atom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class _Request:
    state: RequestState
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput or an exception


class AsyncLLM:
    def __init__(self, config: Config, tokenizer=None):
        self.config = config
        mc = config.model_config
        self.tokenizer = tokenizer or load_tokenizer(mc.tokenizer, mc.trust_remote_code)
        self.eos_token_ids = eos_token_ids(mc.model, mc.hf_config, self.tokenizer)
        self.client = AsyncEngineCoreClient(config, self._on_outputs, self._on_add_error, self._on_dead)
        self.requests: dict[str, _Request] = {}
        # called with every finished (or aborted) request's last output, e.g. for metrics
        self.finished_callbacks: list[Callable[[RequestOutput], None]] = []

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        return cls(args.create_engine_config())

    async def start(self) -> CoreInfo:
        info = await self.client.start()
        logger.info("engine core ready: %d KV blocks of %d tokens, longest sequence %d tokens",
                    info.num_blocks, info.block_size, info.max_seq_len)
        return info

    async def __aenter__(self) -> AsyncLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    @property
    def info(self) -> CoreInfo:
        return self.client.info

    @property
    def is_healthy(self) -> bool:
        return self.client.info is not None and not self.client.is_dead

    @property
    def max_seq_len(self) -> int:
        return self.client.info.max_seq_len

    # requests
    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text, token ids) of a text or token-id prompt; ValueError if it is unusable."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.config.model_config.hf_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        return None, ids

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       prompt_text: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request; the last has ``finished`` set. Raises
        ValueError for a request the engine refuses and EngineDeadError if the engine died."""
        arrival = time.time()
        if self.client.is_dead:
            raise EngineDeadError(f"the engine core process is dead: {self.client.dead_reason}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.encode(prompt)
        req = _Request(RequestState(request_id, prompt_text or text, ids, params, self.tokenizer,
                                    arrival_time=arrival))
        self.requests[request_id] = req
        finished = False
        try:
            self.client.add_request(EngineCoreRequest(request_id, ids, params, self.eos_token_ids, arrival))
            while not finished:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # cancelled or abandoned by its consumer
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        logger.debug("aborting request %s", request_id)
        self._record_finished(req.state, "abort")
        if not self.client.is_dead:
            self.client.abort_requests([request_id])

    # engine
    async def get_stats(self, fresh: bool = True) -> EngineStats | None:
        """The core's stats; ``fresh`` asks the core (after every message sent before)."""
        if fresh and not self.client.is_dead:
            return await self.client.call("stats", timeout=10.0)
        return self.client.stats

    async def start_profile(self) -> None:
        await self.client.call("start_profile")

    async def stop_profile(self) -> None:
        # writing a trace can take a while
        await self.client.call("stop_profile", timeout=600.0)

    async def shutdown(self) -> None:
        for rid in list(self.requests):
            self._fail(rid, EngineDeadError("the engine is shutting down"))
        await self.client.shutdown()

    # callbacks of the reader task
    def _on_outputs(self, outputs: list[EngineCoreOutput], stats: EngineStats) -> None:
        stopped = []
        for out in outputs:
            req = self.requests.get(out.request_id)
            if req is None:
                continue  # aborted while the step ran
            try:
                result, hit_stop_string = req.state.update(out)
            except Exception as e:
                logger.exception("request %s failed while processing its output", out.request_id)
                self._fail(out.request_id, RuntimeError(f"output processing failed: {e}"))
                stopped.append(out.request_id)
                continue
            if hit_stop_string:
                stopped.append(out.request_id)
            if result.finished:
                self.requests.pop(out.request_id, None)
                self._notify_finished(result)
            req.queue.put_nowait(result)
        self.client.abort_requests(stopped)

    def _on_add_error(self, request_id: str, message: str) -> None:
        self._fail(request_id, ValueError(message))

    def _on_dead(self, reason: str) -> None:
        for rid in list(self.requests):
            self._fail(rid, EngineDeadError(f"the engine core process died: {reason.splitlines()[0]}"))

    def _fail(self, request_id: str, error: BaseException) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            req.queue.put_nowait(error)

    def _record_finished(self, state: RequestState, reason: str) -> None:
        # an aborted request still consumed prompt and generated tokens; count them
        out = EngineCoreOutput(state.request_id, [], finish_reason=reason)
        self._notify_finished(state._output(out, "", reason, time.time()))

    def _notify_finished(self, result: RequestOutput) -> None:
        for cb in self.finished_callbacks:
            try:
                cb(result)
            except Exception:
                logger.exception("finished-request callback failed")


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as (index, item), in arrival order. Stopping
    early (or an error in one) closes them all, which aborts their requests."""
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await iterators[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def drain(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
            await queue.put((i, end))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
