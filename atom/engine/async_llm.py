"""``AsyncLLM``: the engine as the API process sees it.

Tokenizing (``InputProcessor``, in a worker thread so that a long prompt never stalls the
event loop), detokenizing and stop strings (``RequestState``) happen here, shared with
``LLMEngine``; the token work happens in the engine core process. Each request owns an
asyncio queue that the reader task fills; ``generate`` drains it. A consumer that stops
early (a client that disconnects, a cancelled task) aborts its request in the core, which
frees its KV blocks. A request whose output processing fails ends with a
``RequestFailedError`` and is aborted in the core; the others go on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from atom.config import Config
from atom.engine.arg_utils import EngineArgs, eos_token_ids, sampling_defaults
from atom.engine.core_client import AsyncEngineCoreClient, CoreInfo, EngineDeadError
from atom.engine.dp_async_client import DPAsyncEngineCoreClient
from atom.engine.dp_balancer import merge_stats
from atom.engine.input_processor import InputProcessor, InvalidInputError, ProcessedPrompt
from atom.engine.llm_engine import load_tokenizer
from atom.engine.output_processor import RequestOutput, RequestState
from atom.engine.outputs import EngineCoreOutput, EngineCoreRequest, EngineStats
from atom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RequestFailedError(RuntimeError):
    """One request failed in the API process or the engine (the others go on)."""

    def __init__(self, request_id: str, message: str):
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id = request_id


class EngineOverloadedError(RuntimeError):
    """Too many requests in flight: the caller should retry later."""


@dataclass
class _Request:
    state: RequestState
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput or an exception


class AsyncLLM:
    def __init__(self, config: Config, tokenizer=None, max_queued_requests: int | None = None):
        """``max_queued_requests``: engine requests allowed beyond ``max_num_seqs`` before
        ``check_capacity`` refuses more (None: no limit)."""
        self.config = config
        mc = config.model_config
        self.tokenizer = tokenizer or load_tokenizer(mc.tokenizer, mc.trust_remote_code)
        self.eos_token_ids = eos_token_ids(mc.model, mc.hf_config, self.tokenizer)
        self.default_sampling_params = sampling_defaults(mc)  # for requests that leave a field out
        # tokens since start-up, counted as their outputs arrive (the server's periodic stats log):
        # a prompt when its first token comes, each generated token when it does
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.input_processor = InputProcessor(self.tokenizer, mc.hf_config.vocab_size, mc.max_model_len,
                                              max_logprobs=mc.max_logprobs)
        # one thread, as vLLM's server: a fast tokenizer releases the GIL while it works,
        # and its settings (truncation) must not change under a concurrent call
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="atom-tokenizer")
        self.max_in_flight = (config.scheduler_config.max_num_seqs + max_queued_requests
                              if max_queued_requests is not None else None)
        # -dp N: N engine-core processes behind the same interface
        dp = config.parallel_config.data_parallel_size
        client_cls = AsyncEngineCoreClient if dp == 1 else DPAsyncEngineCoreClient
        self.client = client_cls(config, self._on_outputs, self._on_add_error, self._on_dead)
        self.requests: dict[str, _Request] = {}
        # engine request ids admitted by check_capacity whose generate() has not registered
        # them yet (it runs later, in a task, for n > 1, several prompts or --request-timeout)
        self._admitted: set[str] = set()
        self._start_stats: list[EngineStats | None] = [None] * dp  # each replica's, read by start()
        # called with every finished (or aborted) request's last output, e.g. for metrics
        self.finished_callbacks: list[Callable[[RequestOutput], None]] = []

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        return cls(args.create_engine_config())

    async def start(self) -> CoreInfo:
        info = await self.client.start()
        self.input_processor.max_seq_len = info.max_seq_len
        # /metrics has numbers for every replica before its first step
        self._start_stats = await self.client.call_each("stats")
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

    @property
    def dead_reason(self) -> str:
        """Why the engine is not running, in one line (the log has the traceback)."""
        reason = (self.client.dead_reason or "the engine is not running").strip().splitlines()
        return reason[0] if len(reason) == 1 else f"{reason[0].rstrip(':')}: {reason[-1].strip()}"

    # input processing, off the event loop
    async def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True, param: str = "prompt",
                       check_length: bool = True, truncate: int | None = None) -> ProcessedPrompt:
        """A text or token-id prompt as checked token ids (``truncate``: its last tokens only);
        ``InvalidInputError`` (a ValueError naming ``param``) if it is unusable."""
        return await self._in_pool(self.input_processor.tokenize, prompt, add_special_tokens, param, check_length,
                                   truncate)  # fmt: skip

    async def apply_chat_template(self, messages: list[dict], **kwargs) -> ProcessedPrompt:
        return await self._in_pool(self.input_processor.apply_chat_template, messages, **kwargs)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self._in_pool(self.tokenizer.decode, token_ids)

    async def _in_pool(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, lambda: fn(*args, **kwargs))

    def check_capacity(self, num_requests: int, request_ids: list[str] | None = None) -> None:
        """Refuse ``num_requests`` more engine requests if the queue is full (503: retry), or
        if they could never fit (400: a retry would fail the same way). ``request_ids`` are
        counted as in flight from now until ``generate`` registers them or ``release`` drops them."""
        if self.max_in_flight is None:
            return
        if num_requests > self.max_in_flight:
            raise InvalidInputError(f"this request needs {num_requests} sequences (prompts x n), more than the "
                                    f"server holds at once ({self.max_in_flight}); lower n or send fewer prompts",
                                    param="n")  # fmt: skip
        in_flight = len(self.requests) + len(self._admitted)
        if in_flight + num_requests > self.max_in_flight:
            raise EngineOverloadedError(f"the server is at capacity ({in_flight} of {self.max_in_flight} "
                                        "requests in flight); retry later")
        self._admitted.update(request_ids or ())

    def release(self, request_ids: list[str]) -> None:
        """Drop admitted ``request_ids`` that never reached ``generate`` (idempotent)."""
        self._admitted.difference_update(request_ids)

    # requests
    async def generate(self, prompt: str | list[int] | ProcessedPrompt, params: SamplingParams, request_id: str,
                       prompt_text: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request; the last has ``finished`` set. Raises
        ValueError for a request the engine refuses, RequestFailedError if processing this
        request failed, and EngineDeadError if the engine died. One sample a request: for
        ``n`` > 1, one call per ``params.sample(i)`` (as the server fans out)."""
        arrival = time.time()
        if params.n != 1:  # refused rather than quietly running one sample
            raise ValueError(f"AsyncLLM.generate runs one sample a request, got n={params.n}: call it once per "
                             "params.sample(i), i < n")
        if self.client.is_dead:
            raise EngineDeadError(f"the engine is dead: {self.dead_reason}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        processed = prompt if isinstance(prompt, ProcessedPrompt) else await self.tokenize(prompt)
        self.input_processor.process_params(params)  # a few short words: no need for the pool
        ids = processed.token_ids
        params = self.input_processor.resolve_max_tokens(params, len(ids))
        req = _Request(RequestState(request_id, prompt_text or processed.text, ids, params, self.tokenizer,
                                    arrival_time=arrival))
        self.requests[request_id] = req
        self._admitted.discard(request_id)
        finished = False
        try:
            # the replica that runs it: its outputs and metrics are attributed to it
            req.state.engine_index = self.client.add_request(
                EngineCoreRequest(request_id, ids, params, self.eos_token_ids, arrival))
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
        """The core's stats (under ``-dp`` the replicas' merged); ``fresh`` asks the core (after
        every message sent before), else the latest (``get_replica_stats``)."""
        if fresh and not self.client.is_dead:
            return await self.client.call("stats", timeout=10.0)
        latest = await self.get_replica_stats(fresh=False)
        return merge_stats(latest) if all(s is not None for s in latest) else None

    async def get_replica_stats(self, fresh: bool = True) -> list[EngineStats | None]:
        """Each replica's stats by data-parallel rank (one entry without ``-dp``); ``fresh`` asks
        every core, else each one's latest: what it sent with its last step or abort, its
        start-up stats before that (None before ``start``)."""
        if fresh and not self.client.is_dead:
            return await self.client.call_each("stats", timeout=10.0)
        return [latest or start for latest, start in zip(self.client.replica_stats, self._start_stats)]

    async def start_profile(self) -> None:
        await self.client.call("start_profile")

    async def stop_profile(self) -> None:
        # writing a trace can take a while
        await self.client.call("stop_profile", timeout=600.0)

    async def shutdown(self) -> None:
        for rid in list(self.requests):
            self._fail(rid, EngineDeadError("the engine is shutting down"))
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        await self.client.shutdown()

    # callbacks of the reader task
    def _on_outputs(self, outputs: list[EngineCoreOutput], stats: EngineStats) -> None:
        stopped = []
        for out in outputs:
            req = self.requests.get(out.request_id)
            if req is None:
                continue  # aborted while the step ran
            try:
                if self._process_output(req, out):
                    stopped.append(out.request_id)
            except Exception as e:  # this request fails alone: abort it, go on with the others
                logger.exception("request %s failed while processing its output", out.request_id)
                self._fail(out.request_id, RequestFailedError(out.request_id,
                                                              f"output processing failed ({type(e).__name__})"))
                stopped.append(out.request_id)
        self.client.abort_requests(stopped)

    def _process_output(self, req: _Request, out: EngineCoreOutput) -> bool:
        """Detokenize one core output and hand it to its consumer; True if the request
        must be aborted in the core (a stop string matched)."""
        if out.finish_reason == "error":  # the engine failed this request alone
            self._fail(out.request_id, RequestFailedError(out.request_id, "the engine could not process it"))
            return False
        if req.state.first_token_time is None and out.new_token_ids:
            self.num_prompt_tokens += len(req.state.prompt_token_ids)
        self.num_generation_tokens += len(out.new_token_ids)
        result, hit_stop_string = req.state.update(out)
        if result.finished:
            self.requests.pop(out.request_id, None)
            self._notify_finished(result)
        req.queue.put_nowait(result)
        return hit_stop_string

    def _on_add_error(self, request_id: str, message: str) -> None:
        self._fail(request_id, ValueError(message))

    def _on_dead(self, reason: str) -> None:
        for rid in list(self.requests):
            self._fail(rid, EngineDeadError(f"the engine is dead: {self.dead_reason}"))

    def _fail(self, request_id: str, error: BaseException) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            if isinstance(error, RequestFailedError):
                self._record_finished(req.state, "error")
            req.queue.put_nowait(error)

    def _record_finished(self, state: RequestState, reason: str) -> None:
        # an aborted request still consumed prompt and generated tokens; count them
        try:
            out = EngineCoreOutput(state.request_id, [], finish_reason=reason)
            self._notify_finished(state._output(out, "", reason, time.time()))
        except Exception:
            logger.exception("could not record the end of request %s", state.request_id)

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
