"""One async request per serving backend, timed token by token.

Adapted from vLLM's ``benchmarks/backend_request_func.py``. Each function in
``ASYNC_REQUEST_FUNCS`` sends a single generation request described by a
``RequestFuncInput`` and returns a ``RequestFuncOutput`` with the client-side
timings: time to first token (TTFT), the inter-token latencies (ITL) and the
end-to-end latency. Failures never raise: they come back as
``success=False`` with the reason in ``error``, so that one bad request does not
abort a benchmark of thousands.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
from tqdm.asyncio import tqdm

# Long generations at high concurrency can legitimately take a long time; the
# limit only guards against a server that hangs forever.
AIOHTTP_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


@dataclass
class RequestFuncInput:
    prompt: str
    api_url: str
    prompt_len: int
    output_len: int
    model: str
    model_name: str | None = None
    logprobs: int | None = None
    best_of: int = 1
    extra_body: dict | None = None
    ignore_eos: bool = False


@dataclass
class RequestFuncOutput:
    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    # None means "unknown": the benchmark then counts the tokens of
    # generated_text with the tokenizer.
    output_tokens: int | None = None
    ttft: float = 0.0  # time to first token
    itl: list[float] = field(default_factory=list)  # inter-token latencies
    tpot: float = 0.0  # mean time per output token after the first
    prompt_len: int = 0
    error: str = ""


RequestFunc = Callable[..., Awaitable[RequestFuncOutput]]


# ---------------------------------------------------------------------------
# Server-sent events
# ---------------------------------------------------------------------------


def _sse_payload(line: bytes) -> str | None:
    """The payload of one SSE line, or None for lines that carry no data."""
    text = line.strip().decode("utf-8")
    # Blank lines separate events; lines starting with ':' are comments, which
    # TGI uses as keep-alive pings.
    if not text or text.startswith(":"):
        return None
    if text.startswith("data:"):
        return text[len("data:") :].strip()
    if text.split(":", 1)[0] in ("event", "id", "retry"):
        return None
    # Some servers stream bare JSON lines without the "data:" field name.
    return text


class SSEDecoder:
    """Splits a streamed HTTP body into the ``data:`` payloads of server-sent events.

    aiohttp's line iterator (``async for line in response.content``) fails on a
    line longer than its 64 KiB buffer, which one JSON event can exceed (for
    example with logprobs), so raw chunks are buffered here instead. Splitting
    on b"\\n" is safe for UTF-8: that byte never occurs inside a multi-byte
    character.
    """

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        return [p for p in map(_sse_payload, lines) if p is not None]

    def flush(self) -> list[str]:
        line, self._buffer = self._buffer, b""
        payload = _sse_payload(line)
        return [] if payload is None else [payload]


async def _iter_sse(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    decoder = SSEDecoder()
    async for chunk in response.content.iter_any():
        for payload in decoder.feed(chunk):
            yield payload
    for payload in decoder.flush():
        yield payload


# ---------------------------------------------------------------------------
# Helpers shared by the request functions
# ---------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _session_scope(session: aiohttp.ClientSession | None):
    """Use the caller's session when given (one connection pool for the whole
    benchmark), else a private one for this request."""
    if session is not None:
        yield session
        return
    async with aiohttp.ClientSession(trust_env=True, timeout=AIOHTTP_TIMEOUT) as own_session:
        yield own_session


def _auth_headers() -> dict[str, str]:
    api_key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _require_suffix(api_url: str, suffixes: tuple[str, ...], api_name: str) -> None:
    if not api_url.endswith(suffixes):
        raise ValueError(
            f"{api_name} URL must end with {' or '.join(repr(s) for s in suffixes)}, got {api_url!r}. "
            "Set --endpoint accordingly."
        )


async def _http_error(response: aiohttp.ClientResponse) -> str:
    body = await response.text()
    return f"HTTP {response.status} {response.reason}: {body[:1000]}"


def _exception_error(api_url: str, exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError):
        # The common case of a server that is not (yet) running: say so plainly
        # instead of dumping an aiohttp traceback.
        return f"Cannot connect to {api_url}: {exc}"
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def _finish(output: RequestFuncOutput, pbar: tqdm | None) -> RequestFuncOutput:
    if output.success and output.output_tokens and output.output_tokens > 1:
        output.tpot = (output.latency - output.ttft) / (output.output_tokens - 1)
    if pbar is not None:
        pbar.update(1)
    return output


class _TokenTimer:
    """Records TTFT and ITLs from the arrival times of streamed token chunks."""

    def __init__(self, output: RequestFuncOutput) -> None:
        self.output = output
        self.start = time.perf_counter()
        self.most_recent = self.start
        self.received_first = False

    def token_arrived(self) -> None:
        now = time.perf_counter()
        if not self.received_first:
            self.received_first = True
            self.output.ttft = now - self.start
        else:
            self.output.itl.append(now - self.most_recent)
        self.most_recent = now

    def finish(self) -> None:
        self.output.latency = self.most_recent - self.start


# ---------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------


async def async_request_tgi(
    request_func_input: RequestFuncInput,
    pbar: tqdm | None = None,
    session: aiohttp.ClientSession | None = None,
) -> RequestFuncOutput:
    api_url = request_func_input.api_url
    _require_suffix(api_url, ("generate_stream",), "TGI")
    params = {
        "max_new_tokens": request_func_input.output_len,
        "do_sample": True,
        "temperature": 0.01,  # TGI does not accept 0.0 temperature.
        "top_p": 0.99,  # TGI does not accept 1.0 top_p.
        "truncate": request_func_input.prompt_len,
        "ignore_eos_token": request_func_input.ignore_eos,
    }
    payload = {"inputs": request_func_input.prompt, "parameters": params}
    output = RequestFuncOutput(prompt_len=request_func_input.prompt_len)
    if request_func_input.ignore_eos:
        output.output_tokens = request_func_input.output_len

    timer = _TokenTimer(output)
    try:
        async with _session_scope(session) as s, s.post(url=api_url, json=payload) as response:
            if response.status == 200:
                async for chunk in _iter_sse(response):
                    data = json.loads(chunk)
                    timer.token_arrived()
                    # Only the last event carries the full text.
                    if data.get("generated_text") is not None:
                        output.generated_text = data["generated_text"]
                timer.finish()
                output.success = timer.received_first
                if not output.success:
                    output.error = "The stream ended without any token."
            else:
                output.error = await _http_error(response)
    except Exception as exc:
        output.error = _exception_error(api_url, exc)
    return _finish(output, pbar)


async def async_request_trt_llm(
    request_func_input: RequestFuncInput,
    pbar: tqdm | None = None,
    session: aiohttp.ClientSession | None = None,
) -> RequestFuncOutput:
    api_url = request_func_input.api_url
    _require_suffix(api_url, ("generate_stream",), "TensorRT-LLM")
    payload = {
        "accumulate_tokens": True,
        "text_input": request_func_input.prompt,
        "temperature": 0.0,
        "top_p": 1.0,
        "max_tokens": request_func_input.output_len,
        "stream": True,
    }
    if request_func_input.ignore_eos:
        payload["min_length"] = request_func_input.output_len
    output = RequestFuncOutput(prompt_len=request_func_input.prompt_len)

    timer = _TokenTimer(output)
    try:
        async with _session_scope(session) as s, s.post(url=api_url, json=payload) as response:
            if response.status == 200:
                async for chunk in _iter_sse(response):
                    data = json.loads(chunk)
                    output.generated_text += data["text_output"]
                    timer.token_arrived()
                timer.finish()
                output.success = timer.received_first
                if not output.success:
                    output.error = "The stream ended without any token."
            else:
                output.error = await _http_error(response)
    except Exception as exc:
        output.error = _exception_error(api_url, exc)
    return _finish(output, pbar)


async def async_request_deepspeed_mii(
    request_func_input: RequestFuncInput,
    pbar: tqdm | None = None,
    session: aiohttp.ClientSession | None = None,
) -> RequestFuncOutput:
    api_url = request_func_input.api_url
    _require_suffix(api_url, ("completions",), "DeepSpeed-MII (OpenAI Completions API)")
    payload = {
        "model": request_func_input.model,
        "prompt": request_func_input.prompt,
        "max_tokens": request_func_input.output_len,
        "temperature": 0.01,  # deepspeed-mii does not accept 0.0 temperature.
        "top_p": 1.0,
    }
    output = RequestFuncOutput(prompt_len=request_func_input.prompt_len)
    # DeepSpeed-MII does not stream, so there is no first-token time: TTFT
    # stays 0 and the whole response counts as latency.
    st = time.perf_counter()
    try:
        async with (
            _session_scope(session) as s,
            s.post(url=api_url, json=payload, headers=_auth_headers()) as response,
        ):
            if response.status == 200:
                parsed = await response.json()
                output.latency = time.perf_counter() - st
                if "choices" in parsed:
                    output.generated_text = parsed["choices"][0]["text"]
                    output.success = True
                elif "text" in parsed:
                    output.generated_text = parsed["text"][0]
                    output.success = True
                else:
                    output.error = "Unexpected response format: neither 'choices' nor 'text' found"
            else:
                output.error = await _http_error(response)
    except Exception as exc:
        output.error = _exception_error(api_url, exc)
    return _finish(output, pbar)


async def async_request_openai_completions(
    request_func_input: RequestFuncInput,
    pbar: tqdm | None = None,
    session: aiohttp.ClientSession | None = None,
) -> RequestFuncOutput:
    api_url = request_func_input.api_url
    _require_suffix(api_url, ("completions",), "OpenAI Completions API")
    payload = {
        "model": request_func_input.model_name or request_func_input.model,
        "prompt": request_func_input.prompt,
        "temperature": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": request_func_input.output_len,
        "logprobs": request_func_input.logprobs,
        "stream": True,
        # The final usage chunk gives the exact number of generated tokens, so
        # the benchmark does not have to re-tokenize the text.
        "stream_options": {"include_usage": True},
    }
    if request_func_input.best_of > 1:
        payload["best_of"] = request_func_input.best_of
    if request_func_input.ignore_eos:
        payload["ignore_eos"] = True
    if request_func_input.extra_body:
        payload.update(request_func_input.extra_body)
    output = RequestFuncOutput(prompt_len=request_func_input.prompt_len)

    timer = _TokenTimer(output)
    try:
        async with (
            _session_scope(session) as s,
            s.post(url=api_url, json=payload, headers=_auth_headers()) as response,
        ):
            if response.status == 200:
                async for chunk in _iter_sse(response):
                    if chunk == "[DONE]":
                        continue
                    data = json.loads(chunk)
                    # The usage summary chunk has no choices and is not a token.
                    if choices := data.get("choices"):
                        # The text can be empty, e.g. for special tokens; it is
                        # still a generated token.
                        timer.token_arrived()
                        output.generated_text += choices[0].get("text") or ""
                    if usage := data.get("usage"):
                        output.output_tokens = usage.get("completion_tokens")
                timer.finish()
                output.success = timer.received_first
                if not output.success:
                    output.error = "Never received a valid chunk to calculate TTFT."
            else:
                output.error = await _http_error(response)
    except Exception as exc:
        output.error = _exception_error(api_url, exc)
    return _finish(output, pbar)


async def async_request_openai_chat_completions(
    request_func_input: RequestFuncInput,
    pbar: tqdm | None = None,
    session: aiohttp.ClientSession | None = None,
) -> RequestFuncOutput:
    api_url = request_func_input.api_url
    _require_suffix(api_url, ("chat/completions",), "OpenAI Chat Completions API")
    payload = {
        "model": request_func_input.model_name or request_func_input.model,
        "messages": [{"role": "user", "content": request_func_input.prompt}],
        "temperature": 0.0,
        "max_completion_tokens": request_func_input.output_len,
        # Older servers only know max_tokens.
        "max_tokens": request_func_input.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request_func_input.logprobs is not None:
        payload["logprobs"] = True
        payload["top_logprobs"] = request_func_input.logprobs
    if request_func_input.ignore_eos:
        payload["ignore_eos"] = True
    if request_func_input.extra_body:
        payload.update(request_func_input.extra_body)
    headers = {"Content-Type": "application/json", **_auth_headers()}
    output = RequestFuncOutput(prompt_len=request_func_input.prompt_len)

    timer = _TokenTimer(output)
    try:
        async with (
            _session_scope(session) as s,
            s.post(url=api_url, json=payload, headers=headers) as response,
        ):
            if response.status == 200:
                async for chunk in _iter_sse(response):
                    if chunk == "[DONE]":
                        continue
                    data = json.loads(chunk)
                    if choices := data.get("choices"):
                        delta = choices[0].get("delta") or {}
                        content = delta.get("content")
                        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                        # A server may announce the assistant role in a chunk of
                        # its own before any token exists; timing it would make
                        # TTFT look near zero.
                        if "role" in delta and not content and not reasoning:
                            continue
                        timer.token_arrived()
                        # Reasoning text is kept so that counting tokens with the
                        # tokenizer (when the server sends no usage) includes it.
                        output.generated_text += (reasoning or "") + (content or "")
                    if usage := data.get("usage"):
                        output.output_tokens = usage.get("completion_tokens")
                timer.finish()
                output.success = timer.received_first
                if not output.success:
                    output.error = "Never received a valid chunk to calculate TTFT."
            else:
                output.error = await _http_error(response)
    except Exception as exc:
        output.error = _exception_error(api_url, exc)
    return _finish(output, pbar)


def get_tokenizer(
    pretrained_model_name_or_path: str,
    tokenizer_mode: str = "auto",
    trust_remote_code: bool = False,
    **kwargs,
):
    """Load a Hugging Face tokenizer from a local directory or a hub name."""
    from transformers import AutoTokenizer

    if tokenizer_mode == "slow":
        kwargs["use_fast"] = False
    return AutoTokenizer.from_pretrained(
        pretrained_model_name_or_path, trust_remote_code=trust_remote_code, **kwargs
    )


ASYNC_REQUEST_FUNCS: dict[str, RequestFunc] = {
    "tgi": async_request_tgi,
    "vllm": async_request_openai_completions,
    "lmdeploy": async_request_openai_completions,
    "deepspeed-mii": async_request_deepspeed_mii,
    "openai": async_request_openai_completions,
    "openai-chat": async_request_openai_chat_completions,
    "tensorrt-llm": async_request_trt_llm,
    "scalellm": async_request_openai_completions,
    "sglang": async_request_openai_completions,
}

OPENAI_COMPATIBLE_BACKENDS = [
    name
    for name, func in ASYNC_REQUEST_FUNCS.items()
    if func in (async_request_openai_completions, async_request_openai_chat_completions)
]

# The endpoint each request function can talk to, checked before a benchmark
# starts so that a wrong --endpoint fails at once with a clear message.
_ENDPOINT_SUFFIXES: dict[RequestFunc, tuple[tuple[str, ...], str]] = {
    async_request_tgi: (("generate_stream",), "TGI"),
    async_request_trt_llm: (("generate_stream",), "TensorRT-LLM"),
    async_request_deepspeed_mii: (("completions",), "DeepSpeed-MII (OpenAI Completions API)"),
    async_request_openai_completions: (("completions",), "OpenAI Completions API"),
    async_request_openai_chat_completions: (("chat/completions",), "OpenAI Chat Completions API"),
}


def check_api_url(backend: str, api_url: str) -> None:
    """Raise ValueError if ``api_url`` is not an endpoint ``backend`` can use."""
    if backend not in ASYNC_REQUEST_FUNCS:
        raise ValueError(f"Unknown backend: {backend}. Choices: {list(ASYNC_REQUEST_FUNCS)}")
    suffixes, api_name = _ENDPOINT_SUFFIXES[ASYNC_REQUEST_FUNCS[backend]]
    _require_suffix(api_url, suffixes, f"Backend {backend!r} ({api_name})")
