"""Pydantic models of the OpenAI-compatible API (serving guide section 1.2-1.3), with the
fields that the ``openai`` client, lm-eval and vLLM users send."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, computed_field, field_validator, model_validator

from atom.sampling_params import INT32_MAX, INT64_MAX, INT64_MIN, is_encodable

logger = logging.getLogger(__name__)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _encodable(s: str) -> str:
    if not is_encodable(s):
        raise ValueError("must be valid Unicode: it holds a lone surrogate (e.g. \\ud800)")
    return s


# every string of a request: JSON can spell a lone surrogate ("\ud800"), which no
# tokenizer and no UTF-8 response can hold
Text = Annotated[str, AfterValidator(_encodable)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class OpenAIBaseModel(BaseModel):
    # NaN and Infinity are not JSON, though Python's parser takes them
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class OpenAIRequest(OpenAIBaseModel):
    """Unknown fields are ignored with a warning in the log, as vLLM does (OpenAI refuses
    them): clients and benchmark tools send fields of other servers."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="after")
    def _ignore_unknown(self):
        if self.model_extra:
            logger.warning("ignored unknown request fields: %s", ", ".join(ascii(k) for k in self.model_extra))
            self.model_extra.clear()
        return self


# errors


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# requests


class StreamOptions(OpenAIRequest):
    include_usage: bool = False


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's ``structured_outputs`` field: exactly one constraint. Unknown keys are a 400
    (a constraint the server cannot see would be silently ignored)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


# fields whose null means their default (not an error)
_NULLABLE_DEFAULTS = frozenset({"n", "stream", "echo", "ignore_eos", "min_tokens", "include_stop_str_in_output",
                                "skip_special_tokens", "spaces_between_special_tokens", "add_generation_prompt",
                                "continue_final_message", "logprobs"})

# OpenAI request fields atom does not implement: refused (400) rather than ignored
UNSUPPORTED_FIELDS = ("functions", "function_call", "audio", "prediction", "web_search_options",
                      "guided_whitespace_pattern", "structural_tag")


class SamplingRequest(OpenAIRequest):
    """The fields both endpoints share, with the ranges the engine can represent."""

    model: Text | None = None
    # None: the server's default (the model's generation_config.json, else 1.0 / 1.0 / off)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    # None: the model's max_new_tokens (--generation-config), else what the context leaves (chat, vLLM's)
    # or 256 (completions); at most what the context leaves
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    n: int = Field(1, ge=1, le=128)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    # logits processing (checked by SamplingParams, which names the field)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    bad_words: list[Text] | None = None
    allowed_token_ids: list[TokenId] | None = None
    best_of: int | None = None
    # vLLM's: the prompt's and the output's token ids beside the text (streamed: the prompt's in the
    # first chunk, each chunk's new ones)
    return_token_ids: bool | None = None
    # vLLM's: logprobs' tokens as "token_id:{id}" (None: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    # structured output (OpenAI's response_format; vLLM's structured_outputs and guided_*)
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_decoding_backend: Text | None = None
    modalities: list[Text] | None = None
    # vLLM's output and prompt controls
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    # vLLM's: each prompt position's logprob and the top N (at most --max-logprobs), not with stream
    prompt_logprobs: int | None = Field(None, ge=0, le=INT64_MAX)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """``null`` for a field with a default means the default (OpenAI's spec lets clients send it)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in _NULLABLE_DEFAULTS}
        return data

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, v, info):
        if v is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available when stream=true (as vLLM)")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported_fields(cls, data):
        if isinstance(data, dict):
            given = [k for k in UNSUPPORTED_FIELDS if data.get(k) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} not supported by atom")
        return data

    @model_validator(mode="after")
    def _unsupported(self):
        if not self.spaces_between_special_tokens:
            raise ValueError("spaces_between_special_tokens=false is not supported by atom")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the context length) or at least 1")
        if self.best_of not in (None, 1, self.n):
            raise ValueError("best_of is not supported by atom (only best_of == n)")
        if self.guided_decoding_backend not in (None, "auto", "xgrammar"):
            raise ValueError("guided_decoding_backend: atom's structured output uses xgrammar only")
        if self.modalities not in (None, ["text"]):
            raise ValueError("modalities: atom generates text only")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextContentPart(OpenAIRequest):
    type: Literal["text"] = "text"
    text: Text


class ChatMessage(OpenAIRequest):
    role: Text
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: Text | None = None  # a tool turn: the call it answers
    # an earlier turn's reasoning (interleaved thinking): vLLM's name, or the older one it still takes
    reasoning: Text | None = None
    reasoning_content: Text | None = None

    @model_validator(mode="after")
    def _one_reasoning(self) -> ChatMessage:
        if self.reasoning is None:
            self.reasoning = self.reasoning_content
        return self

    def text(self) -> str:
        if isinstance(self.content, list):  # vLLM's "string" content format joins parts by newlines
            return "\n".join(p.text for p in self.content)
        return self.content or ""


class FunctionDefinition(OpenAIBaseModel):
    """A tool's function as OpenAI and vLLM define it; other keys pass to the chat template."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema


class ChatTool(OpenAIBaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingRequest):
    # the schema tells clients (and schema-driven fuzzers) what the handler requires: a
    # non-empty messages list, or its alias prompt
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, json_schema_extra={"anyOf": [
        {"required": [name], "properties": {name: {"minItems": 1}}} for name in ("messages", "prompt")]})

    messages: list[ChatMessage] | None = None
    prompt: list[ChatMessage] | None = None  # the serving guide's alias for messages
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=INT64_MAX)  # at most --max-logprobs
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Text | None = None  # vLLM's: a Jinja template of the request's own
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # vLLM's: the last message's content first, if its role is the response's
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _messages(self):
        if self.messages is None:
            self.messages = self.prompt
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.continue_final_message and self.add_generation_prompt:  # vLLM's rule
            raise ValueError("continue_final_message=true needs add_generation_prompt=false (the final message "
                             "is continued, so no new assistant turn is started)")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    # 0 with echo (vLLM's echo without generation): the prompt and, with logprobs, its logprobs only
    max_tokens: int | None = Field(None, ge=0, le=INT64_MAX)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=INT64_MAX)  # at most --max-logprobs
    suffix: Text | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v):
        if isinstance(v, str) or not v:
            if not v:
                raise ValueError("prompt must not be empty")
            return v
        if any(isinstance(p, (str, list)) and len(p) == 0 for p in v):
            raise ValueError("prompts must not be empty")
        return v

    @model_validator(mode="after")
    def _suffix(self):
        if self.suffix:
            raise ValueError("suffix is not supported by atom")
        return self

    @property
    def echo_only(self) -> bool:
        """Echo without generation (``max_tokens=0``): one token is generated and left out."""
        return self.echo and self.max_tokens == 0

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of text or token-id prompts."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


# responses


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    ttft_s: float | None = None  # time to first token (seconds)
    tpot_s: float | None = None  # time per output token after the first (seconds)
    latency_s: float | None = None  # end-to-end latency (seconds)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's ``Logprob``: one token of a prompt position (``prompt_logprobs``)."""

    logprob: float
    rank: int
    decoded_token: str


# a prompt's logprobs as vLLM gives them: None for the first token, then per position its token and the top N
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ChatLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class _Reasoning(OpenAIBaseModel):
    """The reasoning (``--reasoning-parser``) under vLLM's name, ``reasoning`` (0.26 on), and under the name
    older vLLM and DeepSeek's API use, ``reasoning_content``: clients read one or the other."""

    reasoning_content: str | None = None

    @computed_field
    @property
    def reasoning(self) -> str | None:
        return self.reasoning_content


class ChatResponseMessage(_Reasoning):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(_Reasoning):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: this chunk's


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids: in the first chunk


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "atom"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# /tokenize and /detokenize (vLLM's)


class TokenizeCompletionRequest(OpenAIRequest):
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIRequest):
    model: Text | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequest):
    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
