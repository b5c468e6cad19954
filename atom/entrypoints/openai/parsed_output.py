"""What the tool-call and reasoning parsers hand the serving layer: plain frozen values,
with the OpenAI wire shape from ``to_dict``."""

from __future__ import annotations

import uuid
from dataclasses import dataclass


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def to_dict(self) -> dict:
        return {
            "id": self.id or make_tool_call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: tuple[ToolCall, ...]
    content: str | None  # the text before the first call (all of it when none was called)


@dataclass(frozen=True, slots=True)
class DeltaToolCall:
    """One streamed piece of call ``index``: the first piece carries the id and the name,
    later ones fragments of the arguments' JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_dict(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        function = {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}
        if function:
            out["function"] = function
        return out


@dataclass(frozen=True, slots=True)
class DeltaMessage:
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: tuple[DeltaToolCall, ...] = ()

    def to_dict(self) -> dict:
        """The ``delta`` of a chat.completion.chunk (fields that are set)."""
        out: dict = {}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.content is not None:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [call.to_dict() for call in self.tool_calls]
        return out


def partial_tag_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with: text a stream
    must hold back because the next token may complete the tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
