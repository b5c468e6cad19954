"""One streaming HTTP client for every serving backend, timed token by token (after vLLM's
``backend_request_func.py``). A backend differs only in its endpoint, the JSON body it sends and where an
event keeps its text: ``BACKENDS`` declares those. ``async_request`` never raises for a failed request:
it comes back as ``success=False`` with the reason in ``error``, so one bad request does not abort a run."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import traceback
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import aiohttp

# Long generations at high concurrency can take hours; the limit only guards against a hung server.
AIOHTTP_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


class BenchmarkError(RuntimeError):
    """The benchmark cannot run, e.g. the server is unreachable or the tokenizer cannot be loaded."""


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
    output_tokens: int | None = None  # None: unknown, the benchmark counts generated_text's tokens
    ttft: float = 0.0  # time to first token
    itl: list[float] = field(default_factory=list)  # inter-token latencies
    tpot: float = 0.0  # mean time per output token after the first
    prompt_len: int = 0
    error: str = ""


def _sse_payload(line: bytes) -> str | None:
    """The payload of one SSE line, or None for lines that carry no data."""
    text = line.strip().decode("utf-8")
    # Blank lines separate events; ':' lines are comments (TGI's keep-alive pings).
    if not text or text.startswith(":") or text.split(":", 1)[0] in ("event", "id", "retry"):
        return None
    # Some servers stream bare JSON lines without the "data:" field name.
    return text.removeprefix("data:").strip()


class SSEDecoder:
    """Splits a streamed HTTP body into the payloads of server-sent events. aiohttp's line iterator fails
    on a line over 64 KiB, which one event with logprobs can exceed, so raw chunks are buffered here.
    Splitting on b"\\n" is safe for UTF-8: that byte never occurs inside a multi-byte character."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[str]:
        *lines, self._buffer = (self._buffer + chunk).split(b"\n")
        return [p for p in map(_sse_payload, lines) if p is not None]

    def flush(self) -> list[str]:
        return self.feed(b"\n")


def _openai_body(r: RequestFuncInput, chat: bool) -> dict:
    body = dict(model=r.model_name or r.model, temperature=0.0, max_tokens=r.output_len, stream=True)
    # the final usage chunk gives the exact token count, so the text need not be re-tokenized
    body["stream_options"] = {"include_usage": True}
    if chat:  # max_tokens too, for servers that only know the older name
        body.update(messages=[{"role": "user", "content": r.prompt}], max_completion_tokens=r.output_len)
        if r.logprobs is not None:
            body.update(logprobs=True, top_logprobs=r.logprobs)
    else:
        body.update(prompt=r.prompt, repetition_penalty=1.0, logprobs=r.logprobs)
        if r.best_of > 1:
            body["best_of"] = r.best_of
    return {**body, **({"ignore_eos": True} if r.ignore_eos else {}), **(r.extra_body or {})}


def _chat_text(event: dict) -> str | None:
    if not event.get("choices"):
        return None  # the usage summary
    delta = event["choices"][0].get("delta") or {}
    content, reasoning = delta.get("content"), delta.get("reasoning_content") or delta.get("reasoning")
    # A chunk that only announces the assistant role comes before any token: timing it would make
    # TTFT look near zero. Reasoning text is kept so that counting tokens by text includes it.
    return None if "role" in delta and not content and not reasoning else (reasoning or "") + (content or "")


def _tgi_body(r: RequestFuncInput) -> dict:  # TGI rejects temperature 0 and top_p 1
    params = dict(max_new_tokens=r.output_len, do_sample=True, temperature=0.01, top_p=0.99, truncate=r.prompt_len)
    return {"inputs": r.prompt, "parameters": {**params, "ignore_eos_token": r.ignore_eos}}


def _trt_body(r: RequestFuncInput) -> dict:
    body = dict(accumulate_tokens=True, text_input=r.prompt, temperature=0.0, top_p=1.0, max_tokens=r.output_len)
    return {**body, "stream": True, **({"min_length": r.output_len} if r.ignore_eos else {})}


def _mii_body(r: RequestFuncInput) -> dict:
    return dict(model=r.model, prompt=r.prompt, max_tokens=r.output_len, temperature=0.01, top_p=1.0)


def _mii_text(event: dict) -> str:
    return event["choices"][0]["text"] if "choices" in event else event["text"][0]


@dataclass(frozen=True)
class Backend:
    """How one serving protocol is spoken: where, what is sent, where the text is in an event."""

    endpoint_suffix: str
    body: Callable[[RequestFuncInput], dict]
    # text of one event; None for an event that is not a token (e.g. the usage summary)
    text: Callable[[dict], str | None]
    stream: bool = True  # False: one JSON response, TTFT stays 0 and the whole time is latency


def _completion_text(event: dict) -> str | None:
    return (event["choices"][0].get("text") or "") if event.get("choices") else None


COMPLETIONS = Backend("completions", partial(_openai_body, chat=False), _completion_text)
BACKENDS: dict[str, Backend] = {
    # only TGI's last event carries the full text
    "tgi": Backend("generate_stream", _tgi_body, lambda e: e.get("generated_text") or ""),
    "vllm": COMPLETIONS,
    "lmdeploy": COMPLETIONS,
    "deepspeed-mii": Backend("completions", _mii_body, _mii_text, stream=False),
    "openai": COMPLETIONS,
    "openai-chat": Backend("chat/completions", partial(_openai_body, chat=True), _chat_text),
    "tensorrt-llm": Backend("generate_stream", _trt_body, lambda e: e["text_output"]),
    "scalellm": COMPLETIONS,
    "sglang": COMPLETIONS,
}


def check_api_url(backend: str, api_url: str) -> None:
    """Raise ValueError unless ``api_url`` is an endpoint ``backend`` can use."""
    if backend not in BACKENDS:
        raise ValueError(f"Unknown backend: {backend}. Choices: {list(BACKENDS)}")
    if not api_url.endswith(suffix := BACKENDS[backend].endpoint_suffix):
        raise ValueError(f"Backend {backend!r} URL must end with {suffix!r}, got {api_url!r}. Set --endpoint.")


def _auth_headers() -> dict[str, str]:
    api_key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def async_request(backend: str, request: RequestFuncInput, session: aiohttp.ClientSession, pbar=None):
    """Send one request to ``request.api_url`` the way ``backend`` speaks and time its tokens."""
    b, output = BACKENDS[backend], RequestFuncOutput(prompt_len=request.prompt_len)
    if backend == "tgi" and request.ignore_eos:  # TGI reports no usage; the count is the requested one
        output.output_tokens = request.output_len
    times = [time.perf_counter()]  # the send time, then the arrival of every token

    def on_payload(payload: str) -> None:
        if payload == "[DONE]":
            return
        event = json.loads(payload)
        if (text := b.text(event)) is not None:
            times.append(time.perf_counter())
            output.generated_text += text
        if usage := event.get("usage"):
            output.output_tokens = usage.get("completion_tokens")

    try:
        async with session.post(request.api_url, json=b.body(request), headers=_auth_headers()) as response:
            if response.status != 200:
                output.error = f"HTTP {response.status} {response.reason}: {(await response.text())[:1000]}"
            elif not b.stream:
                on_payload(await response.text())
            else:
                decoder = SSEDecoder()
                async for chunk in response.content.iter_any():
                    for payload in decoder.feed(chunk):
                        on_payload(payload)
                for payload in decoder.flush():
                    on_payload(payload)
    except aiohttp.ClientConnectorError as exc:  # the server is not (yet) running: say so plainly
        output.error = f"Cannot connect to {request.api_url}: {exc}"
    except Exception as exc:
        output.error = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if len(times) > 1 and not output.error:
        output.success, output.latency = True, times[-1] - times[0]
        output.ttft = times[1] - times[0] if b.stream else 0.0
        output.itl = [b - a for a, b in zip(times[1:], times[2:])]
        if output.output_tokens and output.output_tokens > 1:
            output.tpot = (output.latency - output.ttft) / (output.output_tokens - 1)
    elif not output.error:
        output.error = "Never received a valid chunk to calculate TTFT."
    if pbar is not None:
        pbar.update(1)
    return output


def served_model(base_url: str) -> tuple[str, str | None]:
    """(id, root) of the first model of the server's ``GET /v1/models``; root is the path it loaded."""
    try:
        request = urllib.request.Request(f"{base_url}/v1/models", headers=_auth_headers())
        with urllib.request.urlopen(request, timeout=30) as response:
            card = json.load(response)["data"][0]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        msg = f"Cannot ask {base_url}/v1/models which model is served ({exc}); start the server or pass --model"
        raise BenchmarkError(msg) from exc
    return card["id"], card.get("root")


def _hub_reachable() -> bool:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urllib.parse.urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
    except OSError:
        return False
    return True


def get_tokenizer(name: str, tokenizer_mode: str = "auto", trust_remote_code: bool = False):
    """A Hugging Face tokenizer from a local directory, the hub cache, or the hub when it answers.
    Without a network transformers retries the hub for about a minute before failing, so a name that
    is neither local nor cached fails at once when the hub cannot be reached."""
    from transformers import AutoTokenizer

    kwargs = dict(trust_remote_code=trust_remote_code, **({"use_fast": False} if tokenizer_mode == "slow" else {}))
    if not os.path.exists(name):
        with contextlib.suppress(OSError):
            return AutoTokenizer.from_pretrained(name, local_files_only=True, **kwargs)
        if not _hub_reachable():
            raise BenchmarkError(
                f"Cannot load the tokenizer {name!r}: it is not a local path nor in the Hugging Face cache, and the "
                "hub cannot be reached. Pass --tokenizer DIR (a directory with the model's tokenizer files), or "
                "leave out --model to use the server's model."
            )
    return AutoTokenizer.from_pretrained(name, **kwargs)
