"""OpenAI's Responses API (``POST /v1/responses``) as vLLM serves it, for text models: the request,
its input items, the response object and its output items. ``serving_responses`` runs a request
through the chat endpoint's machinery (template, tools, structured output, reasoning parser)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from atom.entrypoints.openai.protocol import OpenAIBaseModel, OpenAIRequest, StructuredOutputsRequest, Text, TokenId
from atom.sampling_params import INT64_MAX, INT64_MIN

# include values: the one that changes the output (logprobs on output_text parts); the others name
# outputs atom has no source for (tool calls of OpenAI's hosted tools, images) and are accepted as vLLM does
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# input


class InputText(OpenAIRequest):
    """A text part of an input message (``output_text`` in an earlier assistant turn sent back)."""

    type: Literal["input_text", "output_text", "text"] = "input_text"
    text: Text


class InputMessage(OpenAIRequest):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class FunctionCallItem(OpenAIRequest):
    """An earlier turn's function call (as the response gave it)."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text


class FunctionCallOutputItem(OpenAIRequest):
    """The client's result of a function call."""

    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[InputText]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


class ReasoningText(OpenAIRequest):
    type: Literal["reasoning_text", "summary_text"] = "reasoning_text"
    text: Text


class ReasoningInputItem(OpenAIRequest):
    """An earlier turn's reasoning: given to the next assistant turn as its ``reasoning``."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] = Field(default_factory=list)

    def text(self) -> str:
        return "\n".join(p.text for p in (self.content or self.summary))


InputItem = Annotated[
    InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningInputItem, Field(discriminator="type")
]


class FunctionTool(OpenAIRequest):
    type: Literal["function"]
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(OpenAIRequest):
    type: Literal["function"]
    name: Text


class TextFormat(OpenAIRequest):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError('a "json_schema" format needs its schema')
        return self


class TextConfig(OpenAIRequest):
    format: TextFormat = Field(default_factory=TextFormat)


class ReasoningConfig(OpenAIRequest):
    effort: Text | None = None
    summary: Text | None = None


class ResponsesRequest(OpenAIRequest):
    model: Text | None = None
    input: Text | list[InputItem]
    instructions: Text | None = None
    previous_response_id: Text | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[Text] | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    metadata: dict[str, Text] | None = None
    user: Text | None = None
    service_tier: Text = "auto"
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's (a regex, a choice, a grammar ...)

    @model_validator(mode="before")
    @classmethod
    def _messages_typed(cls, data):
        """An input item with a role and no type is a message (OpenAI's "easy input message");
        ``null`` for a field with a default is that default."""
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None or k in ("input",)}
        if isinstance(data.get("input"), list):
            data["input"] = [{"type": "message", **item} if isinstance(item, dict) and "type" not in item
                             and "role" in item else item for item in data["input"]]  # fmt: skip
        return data

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v):
        if any(not s for s in ([v] if isinstance(v, str) else (v or []))):
            raise ValueError("stop strings must not be empty")
        return v

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])


# output


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None


class OutputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: item_id("msg"))
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningContent(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIBaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: item_id("rs"))
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningContent] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class FunctionCallOutput(OpenAIBaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: item_id("fc"))
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | ReasoningItem | FunctionCallOutput


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponsesResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: item_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed", "cancelled", "queued"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # the request's settings, echoed as OpenAI's responses carry them
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool = False
    background: bool = False
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str = "disabled"
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str = "auto"
