"""A chat response through the reasoning parser, then the tool-call parser (each optional),
as the serving layer needs it: whole, or delta by delta while it streams."""

from __future__ import annotations

from dataclasses import dataclass

from atom.entrypoints.openai.parsed_output import DeltaMessage, ToolCall
from atom.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from atom.entrypoints.openai.tool_parsers import TOOL_PARSERS


@dataclass(frozen=True, slots=True)
class ParsedResponse:
    reasoning_content: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...]


class ChatResponseParser:
    """One per response. ``reasoning_parser``/``tool_parser``: names as vLLM's
    ``--reasoning-parser`` and ``--tool-call-parser`` take them (None: off)."""

    def __init__(
        self, reasoning_parser: str | None = None, tool_parser: str | None = None, enable_thinking: bool = True
    ):
        for name, known in ((reasoning_parser, REASONING_PARSERS), (tool_parser, TOOL_PARSERS)):
            if name is not None and name not in known:
                raise ValueError(f"unknown parser {name!r}; choose from {', '.join(sorted(known))}")
        self._reasoning = REASONING_PARSERS[reasoning_parser](enable_thinking) if reasoning_parser else None
        self._tools = TOOL_PARSERS[tool_parser]() if tool_parser else None

    def parse(self, text: str) -> ParsedResponse:
        reasoning, content = self._reasoning.extract(text) if self._reasoning else (None, text or None)
        if self._tools is None or content is None:
            return ParsedResponse(reasoning, content, ())
        extracted = self._tools.extract(content)
        return ParsedResponse(reasoning, extracted.content, extracted.tool_calls)

    def parse_delta(self, delta_text: str) -> DeltaMessage | None:
        delta = self._reasoning.extract_streaming(delta_text) if self._reasoning else DeltaMessage(content=delta_text)
        return self._through_tools(delta)

    def finish(self) -> DeltaMessage | None:
        """Text held back at the end of the stream (partial tags that never completed)."""
        delta = self._through_tools(self._reasoning.finish() if self._reasoning else None)
        tail = self._tools.finish() if self._tools else None
        if tail is None:
            return delta
        if delta is None:
            return tail
        return DeltaMessage(
            content=(delta.content or "") + tail.content,
            reasoning_content=delta.reasoning_content,
            tool_calls=delta.tool_calls,
        )

    @property
    def tools_called(self) -> bool:
        """Whether the streamed response called a tool (its finish_reason is "tool_calls")."""
        return self._tools is not None and self._tools.tools_called

    def _through_tools(self, delta: DeltaMessage | None) -> DeltaMessage | None:
        if delta is None or self._tools is None or not delta.content:
            return delta if delta and (delta.content or delta.reasoning_content) else None
        tools = self._tools.extract_streaming(delta.content)
        if tools is None and not delta.reasoning_content:
            return None
        return DeltaMessage(
            reasoning_content=delta.reasoning_content,
            content=tools.content if tools else None,
            tool_calls=tools.tool_calls if tools else (),
        )
