"""One OpenAI-compatible streaming client for every backend (vLLM's ``backend_request_func.py``). A failed
request comes back as ``success=False`` with the reason in ``error``, so it does not abort a long run."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import traceback
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

import aiohttp

_NAMES = "tgi vllm lmdeploy deepspeed-mii openai openai-chat tensorrt-llm scalellm sglang".split()
BACKENDS = {name: "chat/completions" if name == "openai-chat" else "completions" for name in _NAMES}  # URL suffix


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


def _openai_body(r: RequestFuncInput, chat: bool) -> dict:
    # the final usage chunk gives the exact token count, so the text need not be re-tokenized
    body = dict(model=r.model_name or r.model, temperature=0.0, max_tokens=r.output_len, stream=True)
    body |= dict(stream_options={"include_usage": True}) | ({"ignore_eos": True} if r.ignore_eos else {})
    if chat:  # max_tokens too, for servers that only know the older name
        body.update(messages=[{"role": "user", "content": r.prompt}], max_completion_tokens=r.output_len)
        return body | (dict(logprobs=True, top_logprobs=r.logprobs) if r.logprobs is not None else {})
    body.update(prompt=r.prompt, repetition_penalty=1.0, logprobs=r.logprobs)
    return body | ({"best_of": r.best_of} if r.best_of > 1 else {})


def _event(line: bytes) -> dict | None:
    """The JSON event of one server-sent-event line; None for blank lines (they separate events), comments
    (keep-alive pings), ``event:``/``id:``/``retry:`` fields and ``[DONE]``. Bare JSON lines count too."""
    text = line.strip().decode("utf-8")
    if not text or text.startswith(":") or text.split(":", 1)[0] in ("event", "id", "retry"):
        return None
    payload = text.removeprefix("data:").strip()
    return None if payload == "[DONE]" else json.loads(payload)


def _event_text(event: dict) -> str | None:
    """The text of a completion or chat chunk; None for the usage summary and a chat chunk that only
    announces the assistant role (timing it would make TTFT look near zero). Reasoning text is kept, so
    that counting tokens by text includes it."""
    if not event.get("choices"):
        return None
    if (delta := event["choices"][0].get("delta")) is None:
        return event["choices"][0].get("text") or ""
    content, reasoning = delta.get("content"), delta.get("reasoning_content") or delta.get("reasoning")
    return None if "role" in delta and not content and not reasoning else (reasoning or "") + (content or "")


def client_session() -> aiohttp.ClientSession:
    """No cap on connections (aiohttp's 100 would silently cap --max-concurrency), a timeout that only
    guards against a hung server, and a read buffer for any one event (aiohttp's line reader fails on a
    line over twice its 64 KiB default, which an event with logprobs can exceed)."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=6 * 60 * 60)
    return aiohttp.ClientSession(connector=connector, trust_env=True, timeout=timeout, read_bufsize=1 << 24)


def check_api_url(backend: str, api_url: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"Unknown backend: {backend}. Choices: {list(BACKENDS)}")
    if not api_url.endswith(suffix := BACKENDS[backend]):
        raise ValueError(f"Backend {backend!r} URL must end with {suffix!r}, got {api_url!r}. Set --endpoint.")


def _auth_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"} if os.environ.get("OPENAI_API_KEY") else {}


async def async_request(backend: str, request: RequestFuncInput, session: aiohttp.ClientSession, pbar=None):
    """Send ``request`` as ``backend`` through ``session`` (from ``client_session``) and time its tokens."""
    output = RequestFuncOutput(prompt_len=request.prompt_len)
    body = _openai_body(request, chat=BACKENDS[backend] == "chat/completions")
    times = [time.perf_counter()]  # the send time, then the arrival of every token
    try:
        async with session.post(request.api_url, json=body, headers=_auth_headers()) as response:
            if response.status != 200:
                output.error = f"HTTP {response.status} {response.reason}: {(await response.text())[:1000]}"
            else:
                async for line in response.content:  # server-sent events, one a line
                    if (event := _event(line)) is None:
                        continue
                    if (text := _event_text(event)) is not None:
                        times.append(time.perf_counter())
                        output.generated_text += text
                    if usage := event.get("usage"):
                        output.output_tokens = usage.get("completion_tokens")
    except aiohttp.ClientConnectorError as exc:  # the server is not (yet) running: say so plainly
        output.error = f"Cannot connect to {request.api_url}: {exc}"
    except Exception as exc:
        output.error = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if len(times) > 1 and not output.error:
        output.success, output.latency, output.ttft = True, times[-1] - times[0], times[1] - times[0]
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

    hub = urllib.parse.urlsplit(constants.ENDPOINT)
    with contextlib.suppress(OSError):
        if not constants.HF_HUB_OFFLINE:
            socket.create_connection((hub.hostname, hub.port or 443), timeout=3).close()
            return True
    return False


def get_tokenizer(name: str, tokenizer_mode: str = "auto", trust_remote_code: bool = False):
    """A Hugging Face tokenizer from a local directory, the hub cache, or the hub when it answers (offline,
    transformers retries the hub for about a minute: a name neither local nor cached fails at once)."""
    from transformers import AutoTokenizer

    kwargs = dict(trust_remote_code=trust_remote_code, use_fast=tokenizer_mode != "slow")
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
