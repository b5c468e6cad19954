"""Turn the core's token ids into text: incremental detokenization, stop strings, timing.

Used in-process by ``LLMEngine`` and in the API process by ``AsyncLLM``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import msgspec

from atom.engine.outputs import EngineCoreOutput, TokenLogprobs
from atom.sampling_params import SamplingParams

# tokens of context decoded before the new ones, so that a word's leading space and
# multi-byte characters split across tokens come out right
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text of each step's new tokens. A fast (Rust) tokenizer streams through
    ``tokenizers.decoders.DecodeStream``, one native call per token, as vLLM does; others use
    vLLM's prefix/read-offset scheme in Python: decode a short window twice and emit only the
    text that is complete (no trailing U+FFFD from an unfinished multi-byte character). Both
    start from the prompt's last tokens, so a word's leading space comes out right."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.backend = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        self.stream = self._new_stream(self.token_ids) if self.backend is not None else None
        self.read_offset = len(self.token_ids)
        self.prefix_offset = 0

    def _new_stream(self, context: list[int]):
        """A decode stream that has seen ``context`` (None where tokenizers has no streams)."""
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:  # tokenizers < 0.21
            return None
        stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        try:
            for token_id in context:
                stream.step(self.backend, token_id)
        except Exception:  # a context that does not decode: start from nothing (text stays right)
            stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        return stream

    def add(self, token_ids: list[int]) -> str:
        if self.stream is not None:
            return "".join(self._step(t) or "" for t in token_ids)
        self.token_ids.extend(token_ids)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        prefix_text = decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _step(self, token_id: int) -> str | None:
        try:
            return self.stream.step(self.backend, token_id)
        except Exception as e:
            # a tokenizer whose output is not monotonic (invalid UTF-8 that a later token
            # rewrites) breaks the stream's state: start a new one at this token, as vLLM does
            if "Invalid prefix" not in str(e):
                raise
            self.stream = self._new_stream([])
            return self.stream.step(self.backend, token_id)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far (stop string and held-back text excluded)
    new_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None
    latency: float
    ttft: float
    tpot: float
    logprobs: list[TokenLogprobs] | None = None
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    stop_reason: str | int | None = None
    error: str | None = None  # with finish_reason "error": what failed
    # the data-parallel replica that ran it, for the server's per-engine metrics (AsyncLLM and
    # LLMEngine set it; 0 without -dp)
    engine_index: int = 0

    def to_dict(self) -> dict:
        """The serving guide's result dict."""
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "latency": self.latency,
            "finish_reason": self.finish_reason,
            "num_tokens_input": len(self.prompt_token_ids),
            "num_tokens_output": len(self.token_ids),
            "ttft": self.ttft,
            "tpot": self.tpot,
        }


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer, stream_callback=None, arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detokenizer = (IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
                            if tokenizer else None)  # fmt: skip
        self.stream_callback = stream_callback
        # the data-parallel replica that runs it, known once the request is added (AsyncLLM and LLMEngine set it)
        self.engine_index = 0
        self.token_ids: list[int] = []
        self.text = ""  # full decoded text, before stop-string truncation
        self.emitted = 0  # characters of text already streamed
        self.arrival = arrival_time if arrival_time is not None else time.time()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.stop_reason: str | int | None = None
        self.hold = max((len(s) for s in params.stop), default=1) - 1

    def update(self, out: EngineCoreOutput, want_output: bool = True) -> tuple[RequestOutput | None, bool]:
        """Apply one core output; returns (output, stopped_by_string). The output is built
        only if ``want_output`` or the request finished. When a stop string matched, the
        caller must abort the request in the core."""
        if self.params.stop and len(out.new_token_ids) > 1:
            return self._update_each(out, want_output)
        return self._update(out, want_output)

    def _update_each(self, out: EngineCoreOutput, want_output: bool) -> tuple[RequestOutput | None, bool]:
        """Several tokens in one output (speculative decoding), checked for stop strings one
        at a time as they would have arrived: tokens after the one that completes a stop
        string are dropped."""
        ids, deltas = out.new_token_ids, []
        for j in range(len(ids)):
            last = j == len(ids) - 1
            part = msgspec.structs.replace(out, new_token_ids=ids[j : j + 1], new_logprobs=out.new_logprobs[j : j + 1],
                                           prompt_logprobs=out.prompt_logprobs if j == 0 else [],
                                           finish_reason=out.finish_reason if last else None)
            result, stopped = self._update(part, True)
            deltas.append(result.delta_text)
            if stopped or last:
                break
        if not (want_output or result.finished):
            return None, stopped
        return dataclasses.replace(result, new_token_ids=ids[: j + 1], delta_text="".join(deltas),
                                   new_logprobs=out.new_logprobs[: j + 1]), stopped

    def _update(self, out: EngineCoreOutput, want_output: bool) -> tuple[RequestOutput | None, bool]:
        now = time.time()
        if out.new_token_ids:
            self.first_token_time = self.first_token_time or now
            self.last_token_time = now
            self.token_ids.extend(out.new_token_ids)
        if self.logprobs is not None:
            self.logprobs.extend(out.new_logprobs)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(out.prompt_logprobs)
        finish_reason = out.finish_reason
        new_ids = out.new_token_ids
        if out.finish_reason == "stop" and new_ids:  # the core stops on an EOS or a stop_token_ids token
            if new_ids[-1] in self.params.stop_token_ids:
                self.stop_reason = new_ids[-1]
            if not self.params.include_stop_str_in_output:  # as vLLM: that token's text is left out
                new_ids = new_ids[:-1]
        stopped = False
        if self.detokenizer is not None and new_ids:
            old_len = len(self.text)
            self.text += self.detokenizer.add(new_ids)
            # as vLLM: no stop string ends within the first min_tokens tokens' text
            if self.params.stop and len(self.token_ids) > self.params.min_tokens:
                cut = self._find_stop(old_len)
                if cut is not None:
                    keep = len(self.stop_reason) if self.params.include_stop_str_in_output else 0
                    self.text = self.text[: cut + keep]
                    finish_reason, stopped = "stop", True
        finished = finish_reason is not None
        # hold back text that might be the start of a stop string, until it is decided
        visible = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : visible]
        self.emitted = visible
        if not (want_output or finished):
            return None, stopped
        return self._output(out, delta, finish_reason, now), stopped

    def fail(self) -> RequestOutput:
        """The final output of a request that failed while being processed."""
        empty = EngineCoreOutput(self.request_id, [], "error", error="output processing failed")
        return self._output(empty, "", "error", time.time())

    def _find_stop(self, old_len: int) -> int | None:
        """The earliest stop string that ends in the text added after ``old_len``."""
        best = None
        for s in self.params.stop:
            idx = self.text.find(s, max(0, old_len - len(s) + 1))
            if idx != -1 and (best is None or idx < best):
                best, self.stop_reason = idx, s
        return best

    def _output(self, out: EngineCoreOutput, delta: str, finish_reason: str | None, now: float) -> RequestOutput:
        n = len(self.token_ids)
        ttft = (self.first_token_time - self.arrival) if self.first_token_time else 0.0
        tpot = ((self.last_token_time - self.first_token_time) / (n - 1)) if n > 1 else 0.0
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.token_ids if finish_reason is not None else list(self.token_ids),
            text=self.text[: self.emitted],
            new_token_ids=out.new_token_ids,
            delta_text=delta,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            latency=now - self.arrival,
            ttft=ttft,
            tpot=tpot,
            logprobs=self.logprobs,
            new_logprobs=out.new_logprobs,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=out.num_cached_tokens,
            stop_reason=self.stop_reason,
            error=out.error,
            engine_index=self.engine_index,
        )
