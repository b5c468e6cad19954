"""What the chat and completion endpoints share: errors in OpenAI's shape, model-name and
length checks, sampling parameters, running n sub-requests per prompt, usage and SSE."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from atom.engine.async_llm import AsyncLLM, EngineOverloadedError, RequestFailedError, merge_async_iterators
from atom.engine.core_client import EngineDeadError
from atom.engine.input_processor import InvalidInputError, ProcessedPrompt
from atom.engine.output_processor import RequestOutput
from atom.engine.outputs import TokenLogprobs
from atom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ErrorInfo,
    ErrorResponse,
    PromptLogprob,
    PromptLogprobs,
    SamplingRequest,
    TokenizeChatRequest,
    UsageInfo,
)
from atom.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256  # the serving guide's default
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client
T = TypeVar("T")
Prompt = ProcessedPrompt


class OpenAIError(Exception):
    """An error that becomes an HTTP response with OpenAI's error body."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        # a message may quote the client's input: keep it encodable (no lone surrogates)
        message = message.encode("utf-8", "backslashreplace").decode()
        super().__init__(message)
        self.status = status
        self.headers = headers
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status,
                            headers=self.headers)


class RequestTimeoutError(Exception):
    """A request ran past ``--request-timeout``."""


def engine_dead_error(e: Exception) -> OpenAIError:
    return OpenAIError(str(e), status=503, type="service_unavailable_error", code="engine_dead")


def to_openai_error(e: BaseException, request_id: str) -> OpenAIError:
    """The HTTP error for an exception raised while serving ``request_id``."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, InvalidInputError):
        return OpenAIError(str(e), param=e.param, code=e.code)
    if isinstance(e, ValueError):  # refused by SamplingParams or the engine
        named = re.match(r"SamplingParams\.(\w+) ", str(e))
        return OpenAIError(str(e), param=named.group(1) if named else None)
    if isinstance(e, EngineDeadError):
        return engine_dead_error(e)
    if isinstance(e, EngineOverloadedError):
        return OpenAIError(str(e), status=503, type="service_unavailable_error", code="server_overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, RequestTimeoutError):
        return OpenAIError(f"request {request_id} timed out: {e}", status=504, type="timeout_error",
                           code="request_timeout")
    if isinstance(e, RequestFailedError):
        return OpenAIError(str(e), status=500, type="internal_server_error")
    logger.error("request %s failed", request_id, exc_info=e)
    return OpenAIError(f"request {request_id} failed: internal error ({type(e).__name__})", status=500,
                       type="internal_server_error")


def sse(data: BaseModel | str) -> str:
    payload = data if isinstance(data, str) else data.model_dump_json()
    return f"data: {payload}\n\n"


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], request_timeout: float | None = None,
                 trust_request_chat_template: bool = False, return_tokens_as_token_ids: bool = False):
        self.engine = engine
        self.served_model_names = served_model_names
        self.tokenizer = engine.tokenizer
        self.request_timeout = request_timeout
        self.trust_request_chat_template = trust_request_chat_template
        self.return_tokens_as_token_ids = return_tokens_as_token_ids  # --return-tokens-as-token-ids
        self.log_requests = False  # --enable-log-requests

    def check_chat_template(self, chat_template: str | None, chat_template_kwargs: dict | None) -> None:
        """A request's own chat template runs on the server (Jinja, sandboxed but unbounded in
        time): refused unless the server trusts its clients' templates, as vLLM does."""
        given = chat_template is not None or (chat_template_kwargs or {}).get("chat_template") is not None
        if given and not self.trust_request_chat_template:
            raise OpenAIError("Chat template is passed with request, but --trust-request-chat-template is not set. "
                              "Refused request with untrusted chat template.", param="chat_template")

    async def render_chat(self, request: ChatCompletionRequest | TokenizeChatRequest, tools: list[dict] | None,
                          **kwargs) -> Prompt:  # fmt: skip
        """A request's messages (and ``tools``) through the chat template: the prompt the chat endpoint
        and ``/tokenize`` give the same conversation. ``kwargs``: ``apply_chat_template``'s."""
        self.check_chat_template(request.chat_template, request.chat_template_kwargs)
        template_kwargs = dict(request.chat_template_kwargs or {})
        if tools:
            template_kwargs["tools"] = tools
        return await self.engine.apply_chat_template(
            [template_message(m) for m in request.messages], add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message, chat_template_kwargs=template_kwargs,
            chat_template=request.chat_template, **kwargs)  # fmt: skip

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_model_names:
            raise OpenAIError(f"The model `{name}` does not exist.", status=404, param="model",
                              code="model_not_found")

    def check_alive(self) -> None:
        if not self.engine.is_healthy:
            raise engine_dead_error(EngineDeadError(f"the engine is dead: {self.engine.dead_reason}"))

    async def serve(self, request_id: str, handler):
        """Run a request's handler; every failure becomes an OpenAI error naming the request."""
        try:
            return await handler
        except Exception as e:
            raise to_openai_error(e, request_id) from e

    def max_tokens(self, requested: int | None, prompt_len: int, param: str,
                   default: int | None = DEFAULT_MAX_TOKENS) -> int:
        """The request's max_tokens, checked against the context length (400 if over). Left out:
        the model's max_new_tokens (--generation-config), else ``default`` (None: no cap), at
        most what the context leaves."""
        limit = self.engine.max_seq_len
        if prompt_len >= limit:
            raise OpenAIError(f"The prompt has {prompt_len} tokens, but this model's maximum context length "
                              f"is {limit} tokens. Please reduce the length of the prompt.",
                              param=param, code="context_length_exceeded")
        if requested is None:
            cap = self.engine.default_sampling_params.get("max_tokens", default)
            return limit - prompt_len if cap is None else min(cap, limit - prompt_len)
        if prompt_len + requested > limit:
            raise OpenAIError(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the "
                              "completion). Please reduce the length of the prompt or completion.",
                              param="max_tokens", code="context_length_exceeded")
        return requested

    def sampling_params(self, request: SamplingRequest, max_tokens: int, logprobs: int | None = None,
                        prompt_logprobs: int | None = None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        # a field the request leaves out: the model's recommended default (--generation-config), else vLLM's
        default = self.engine.default_sampling_params
        try:
            return SamplingParams(
                temperature=_or(request.temperature, default.get("temperature", 1.0)),
                top_p=_or(request.top_p, default.get("top_p", 1.0)),
                top_k=_or(request.top_k, default.get("top_k", 0)),
                min_p=_or(request.min_p, default.get("min_p", 0.0)),
                max_tokens=max_tokens,
                n=request.n,  # SamplingParams checks that seed + n - 1 fits; sample(i) makes each choice's params
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids or [],
                include_stop_str_in_output=request.include_stop_str_in_output,
                skip_special_tokens=request.skip_special_tokens,
                ignore_eos=request.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                presence_penalty=_or(request.presence_penalty, 0.0),
                frequency_penalty=_or(request.frequency_penalty, 0.0),
                repetition_penalty=_or(request.repetition_penalty, default.get("repetition_penalty", 1.0)),
                logit_bias=request.logit_bias or None,
                min_tokens=request.min_tokens,
                bad_words=request.bad_words or None,
                allowed_token_ids=request.allowed_token_ids,
                structured_outputs=structured,
            )
        except ValueError as e:
            raise to_openai_error(e, "") from e

    def generate(self, request_id: str, prompts: list[Prompt], params: list[SamplingParams],
                 n: int) -> AsyncIterator[tuple[int, RequestOutput]]:
        """All choices of a request as (choice index, output); choice ``p * n + i`` is the
        ``i``-th sample of prompt ``p``. Each is its own engine request; a seeded request
        gives each sample its own seed, so that the samples differ."""
        ids = [f"{request_id}-{p}-{i}" for p in range(len(prompts)) for i in range(n)]
        if self.log_requests:
            for p, (prompt, sp) in enumerate(zip(prompts, params)):
                logger.info("Received request %s-%d (n=%d): prompt of %d tokens, params: %s", request_id, p, n,
                            len(prompt.token_ids), sp)  # fmt: skip
                logger.debug("Request %s-%d prompt token ids: %s", request_id, p, prompt.token_ids)
        # counted as in flight from here: their generate() runs later, in a task of its own with n > 1,
        # several prompts or --request-timeout, so a burst would otherwise pass the check all at once
        self.engine.check_capacity(len(ids), ids)
        streams = []
        for p, (prompt, sp) in enumerate(zip(prompts, params)):
            for i in range(n):
                streams.append(self.engine.generate(prompt, sp.sample(i), ids[p * n + i]))
        return _release_after(with_timeout(merge_async_iterators(*streams), self.request_timeout),
                              functools.partial(self.engine.release, ids))

    async def first_output(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> tuple[int, RequestOutput]:
        """Wait for the first output, so that a request the engine refuses gets an HTTP error
        status rather than a stream that ends in an error."""
        return await anext(outputs)

    async def collect(self, outputs: AsyncIterator[tuple[int, RequestOutput]], num_choices: int) -> list[RequestOutput]:
        """The final output of every choice."""
        finals: list[RequestOutput | None] = [None] * num_choices
        async for i, out in outputs:
            if out.finished:
                finals[i] = out
        return finals

    @staticmethod
    def usage(prompt_lens: list[int], finals: list[RequestOutput], echo_only: bool = False) -> UsageInfo:
        """Token counts plus timing: TTFT of the first choice to start, TPOT averaged over
        the choices, latency of the last choice to finish. ``echo_only``: the generated tokens
        were left out (a completion's echo without generation)."""
        prompt_tokens = sum(prompt_lens)
        completion_tokens = 0 if echo_only else sum(len(o.token_ids) for o in finals)
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            ttft_s=round(min(o.ttft for o in finals), 6),
            tpot_s=round(sum(o.tpot for o in finals) / len(finals), 6),
            latency_s=round(max(o.latency for o in finals), 6),
        )

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one serving object lives as long as the server
    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def tokens_as_ids(self, request: SamplingRequest) -> bool:
        """Whether logprobs show tokens as "token_id:{id}": the request's return_tokens_as_token_ids,
        else the server's --return-tokens-as-token-ids (vLLM's)."""
        wanted = request.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if wanted is None else wanted

    def prompt_logprobs(self, logprobs: list[TokenLogprobs | None] | None, top_n: int) -> PromptLogprobs:
        """vLLM's ``prompt_logprobs``: None for the first token, then each position's own token (with its
        rank in the vocabulary) and the ``top_n`` most likely, keyed by token id."""
        result: PromptLogprobs = []
        for lp in logprobs or []:
            if lp is None:
                result.append(None)
                continue
            entry = {lp.token_id: PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                                decoded_token=self.token_str(lp.token_id))}  # fmt: skip
            for rank, (token_id, value) in enumerate(lp.top[:top_n], 1):
                entry.setdefault(token_id, PromptLogprob(logprob=value, rank=rank,
                                                         decoded_token=self.token_str(token_id)))  # fmt: skip
            result.append(entry)
        return result

    def logprob_token(self, token_id: int, as_id: bool) -> str:
        """A token as logprobs show it: its text, or vLLM's "token_id:{id}"."""
        return f"token_id:{token_id}" if as_id else self.token_str(token_id)

    async def stream_errors(self, request_id: str, chunks: AsyncIterator[str],
                            outputs: AsyncIterator) -> AsyncIterator[str]:
        """SSE ``chunks`` made from the engine ``outputs``, then ``[DONE]``; an error after
        the stream has started becomes a final error event. Closing this stream (a client
        that went away) closes ``outputs``, which aborts the engine requests."""
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as e:
            yield sse(ErrorResponse(error=to_openai_error(e, request_id).info))
        finally:
            await chunks.aclose()
            await outputs.aclose()
        yield sse("[DONE]")


def template_message(message: ChatMessage) -> dict:
    """A request message as chat templates read it: a tool call's arguments as a mapping
    (OpenAI sends them as JSON text; the templates serialise them), as vLLM passes them."""
    out = {"role": message.role, "content": message.text()}
    for key in ("name", "tool_call_id"):
        if getattr(message, key) is not None:
            out[key] = getattr(message, key)
    if message.reasoning is not None:  # under both names, as vLLM gives it: templates read one or the other
        out["reasoning"] = out["reasoning_content"] = message.reasoning
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            function = dict(call.get("function") or {})
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError as e:
                    raise OpenAIError(f"messages: a tool call's arguments are not JSON ({e})", param="messages") from e
            calls.append({**call, "function": function})
        out["tool_calls"] = calls
    return out


async def with_timeout(outputs: AsyncIterator[T], timeout: float | None) -> AsyncIterator[T]:
    """``outputs`` until ``timeout`` seconds have passed, then RequestTimeoutError (closing
    ``outputs``, which aborts the engine requests)."""
    if timeout is None:
        async for item in outputs:
            yield item
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while True:
            try:
                item = await asyncio.wait_for(anext(outputs), max(0.0, deadline - loop.time()))
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise RequestTimeoutError(f"it ran longer than --request-timeout ({timeout:g} s)") from None
            yield item
    finally:
        await outputs.aclose()


async def _release_after(outputs: AsyncIterator[T], release: Callable[[], None]) -> AsyncIterator[T]:
    """``outputs``; then, or when closed early, ``release()`` (the request's engine requests that
    never started stop counting against the queue bound)."""
    try:
        async for item in outputs:
            yield item
    finally:
        release()
        await outputs.aclose()


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    yield first
    async for item in rest:
        yield item


def _or(value, default):
    """A request field's value, or its default where the client sent null."""
    return default if value is None else value
