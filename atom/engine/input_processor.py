"""Prompts into token ids the engine can run: the chat template, tokenisation and the checks
(text that can be encoded, token ids inside the vocabulary, a length that fits the context),
shared by ``LLMEngine``, ``AsyncLLM`` and the server.

Every refusal is an ``InvalidInputError``, a ``ValueError`` that names the request field.
The methods are plain functions of their inputs, so ``AsyncLLM`` runs them in a worker
thread: tokenising a long text must not stall the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from atom.config import ModelConfig
from atom.sampling_params import SamplingParams, is_encodable
from atom.structured_output import GrammarSpec
from atom.worker.penalty_inputs import bad_words_token_ids


class InvalidInputError(ValueError):
    """A prompt the engine refuses; ``param`` is the request field to blame."""

    def __init__(self, message: str, param: str = "prompt", code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    text: str | None  # None for a token-id prompt
    token_ids: list[int]


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_seq_len: int | None = None,
                 max_logprobs: int = ModelConfig.max_logprobs):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        # --max-logprobs: the most logprobs per position a request may ask for (-1: the vocabulary)
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs
        self.max_model_len = max_model_len
        # the longest sequence the engine holds: min(max_model_len, KV cache capacity),
        # known once the KV cache is allocated
        self.max_seq_len = max_seq_len if max_seq_len is not None else max_model_len
        self.max_token_chars = _max_token_chars(tokenizer)

    def tokenize(
        self, prompt: str | list[int], add_special_tokens: bool = True, param: str = "prompt",
        check_length: bool = True, truncate: int | None = None,
    ) -> ProcessedPrompt:  # fmt: skip
        """A text or token-id prompt as token ids, checked (its length only if
        ``check_length``: ``/tokenize`` counts the tokens of any text). ``truncate``: keep the
        last tokens only (vLLM's ``truncate_prompt_tokens``; -1: the context length)."""
        if truncate is not None:
            whole = self.tokenize(prompt, add_special_tokens, param, check_length=False)
            return self._truncated(whole, truncate, param)
        if isinstance(prompt, str):
            return ProcessedPrompt(prompt, self._encode(prompt, add_special_tokens, param, check_length))
        ids = list(prompt)
        if not ids:
            raise InvalidInputError("prompt is empty: at least one token is needed", param)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
            raise InvalidInputError(f"prompt token ids must be ints in [0, {self.vocab_size})", param)
        if check_length:
            self._check_length(len(ids), param)
        return ProcessedPrompt(None, ids)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
        check_length: bool = True,
        chat_template: str | None = None,
        truncate: int | None = None,
    ) -> ProcessedPrompt:
        """The messages through the tokenizer's chat template (or ``chat_template``, a Jinja
        template of the request's own), tokenised; ``truncate`` as in ``tokenize``.
        ``chat_template_kwargs`` may set ``add_generation_prompt`` / ``continue_final_message``
        too (they win, as in vLLM)."""
        if not messages:
            raise InvalidInputError("messages must be a non-empty list", "messages")
        if self.tokenizer is None:
            raise InvalidInputError("chat messages need a tokenizer", "messages")
        kwargs = dict(chat_template_kwargs or {})
        add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
        continue_final_message = kwargs.pop("continue_final_message", continue_final_message)
        reserved = [k for k in ("conversation", "messages", "tokenize", "return_dict", "return_tensors") if k in kwargs]
        if reserved:
            raise InvalidInputError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set here",
                                    "chat_template_kwargs")  # fmt: skip
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        messages = [_text_content(m) for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                **kwargs,
            )
        except Exception as e:  # no template, or the template refused the messages
            raise InvalidInputError(f"cannot apply the chat template: {_printable(e)}", "messages") from e
        # the template already holds the special tokens (BOS, role markers)
        if truncate is not None:
            return self._truncated(ProcessedPrompt(text, self._encode(text, add_special_tokens, "messages", False)),
                                   truncate, "messages")  # fmt: skip
        return ProcessedPrompt(text, self._encode(text, add_special_tokens, "messages", check_length))

    def _truncated(self, prompt: ProcessedPrompt, keep: int, param: str) -> ProcessedPrompt:
        """The prompt's last ``keep`` tokens (-1: as many as the context holds); the text goes
        with a cut (it no longer matches)."""
        limit = self.max_seq_len
        if keep == -1:
            keep = limit
        if not 1 <= keep <= limit:
            raise InvalidInputError(f"truncate_prompt_tokens must be -1 or in [1, {limit}] (the context length), "
                                    f"got {keep}", "truncate_prompt_tokens")  # fmt: skip
        if not prompt.token_ids:
            raise InvalidInputError("prompt is empty: it has no tokens", param)
        if len(prompt.token_ids) <= keep:
            return prompt
        return ProcessedPrompt(None, prompt.token_ids[-keep:])

    def resolve_max_tokens(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """``max_tokens=None`` (vLLM's "as many as fit") made the context's rest for this prompt:
        a copy, so params shared by several prompts stay as given."""
        if params.max_tokens is not None:
            return params
        return replace(params, max_tokens=max(1, self.max_seq_len - prompt_len))

    def process_params(self, params: SamplingParams) -> None:
        """Check the token-id fields against the vocabulary and the structured-output grammar,
        and tokenize ``bad_words`` once (into ``params.bad_words_token_ids``), as vLLM does
        when a request arrives; and the logprobs asked for against ``--max-logprobs``."""
        for name, what in (("logprobs", "sample logprobs"), ("prompt_logprobs", "prompt logprobs")):
            wanted = getattr(params, name)
            if wanted is not None and wanted > self.max_logprobs:  # vLLM's message
                raise InvalidInputError(f"Requested {what} of {wanted}, which is greater than max allowed: "
                                        f"{self.max_logprobs} (--max-logprobs)", name)
        try:
            params.check_token_ids(self.vocab_size)
        except ValueError as e:
            raise InvalidInputError(str(e), str(e).split()[0].removeprefix("SamplingParams.")) from e
        if params.structured_outputs is not None:
            try:  # a grammar that cannot compile fails here, not in the engine core
                GrammarSpec.from_params(params.structured_outputs).validate()
            except ValueError as e:
                raise InvalidInputError(str(e), "structured_outputs") from e
        if params.bad_words and params.bad_words_token_ids is None:
            if self.tokenizer is None:
                raise InvalidInputError("bad_words need a tokenizer", "bad_words")
            try:
                params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
            except ValueError as e:
                raise InvalidInputError(str(e), "bad_words") from e

    def _encode(self, text: str, add_special_tokens: bool, param: str, check_length: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise InvalidInputError("text prompts need a tokenizer (the engine runs with skip_tokenizer_init)", param)
        if not is_encodable(text):
            raise InvalidInputError(f"{param} is not valid Unicode: it holds a lone surrogate (e.g. \\ud800)", param)
        if not check_length:  # /tokenize: any text, the empty one too (vLLM counts its special tokens)
            try:
                return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
            except Exception as e:
                raise InvalidInputError(f"cannot tokenize the {param}: {_printable(e)}", param) from e
        if not text:
            raise InvalidInputError("prompt is empty", param)
        limit = self.max_seq_len
        if self.max_token_chars is not None and len(text) > 2 * limit * self.max_token_chars:
            # no token covers more than max_token_chars characters, so this text cannot
            # fit: refuse it without spending seconds of CPU on tokenising it
            raise self._too_long(f"more than {limit}", param)
        try:
            # truncated in the tokenizer (no Python list of millions of ids): one token
            # past the limit is enough to know that the prompt does not fit
            ids = self.tokenizer(text, add_special_tokens=add_special_tokens, truncation=True, max_length=limit + 1)[
                "input_ids"
            ]
        except Exception as e:
            raise InvalidInputError(f"cannot tokenize the {param}: {_printable(e)}", param) from e
        if not ids:
            raise InvalidInputError("prompt is empty: it has no tokens", param)
        if len(ids) > limit:
            raise self._too_long(f"more than {limit}", param)
        return list(ids)

    def _check_length(self, num_tokens: int, param: str) -> None:
        if num_tokens > self.max_seq_len:
            raise self._too_long(str(num_tokens), param)

    def _too_long(self, count: str, param: str) -> InvalidInputError:
        return InvalidInputError(
            f"prompt of {count} tokens exceeds the limit of {self.max_seq_len} tokens (max_model_len="
            f"{self.max_model_len}, or the KV cache's capacity if smaller)",
            param,
            code="context_length_exceeded",
        )


def _max_token_chars(tokenizer) -> int | None:
    """The most characters one token can stand for, or None where that is unbounded (a
    tokenizer with an unknown-token fallback maps a whole unknown word to one token)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if model is None or type(model).__name__ != "BPE" or model.unk_token is not None:
        return None
    # byte-level tokens spell one byte per character, so a token's text is never longer
    # than its vocabulary string
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def _printable(e: Exception) -> str:
    return str(e).encode("utf-8", "backslashreplace").decode()[:500]


def _text_content(message: Any) -> Any:
    """A message whose content is OpenAI's list of parts, with the text parts joined by newlines
    (vLLM's "string" content format; other messages as given)."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    texts = []
    for part in message["content"]:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidInputError("only text content parts ({'type': 'text', 'text': ...}) are supported", "messages")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}
