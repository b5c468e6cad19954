"""One chat choice's output as the API returns it: reasoning split off (``--reasoning-parser``),
tool calls parsed (``tool_choice`` "auto" with ``--tool-call-parser``) or read from the
constrained output ("required" / a named function), whole or delta by delta.

``finish_reason`` follows vLLM: "tool_calls" when "auto" found calls or "required" made them;
a named function keeps the engine's reason ("stop"), as OpenAI does.
"""

from __future__ import annotations

import json
import logging

from atom.entrypoints.openai.parsed_output import DeltaMessage, DeltaToolCall, ToolCall, make_tool_call_id
from atom.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from atom.entrypoints.openai.response_parser import ChatResponseParser
from atom.entrypoints.openai.structured_request import ToolPlan
from atom.entrypoints.openai.tool_parsers import forced_tool_calls

logger = logging.getLogger(__name__)


class ChoiceOutput:
    """One per choice (a streamed choice keeps its state between deltas)."""

    def __init__(
        self, plan: ToolPlan, reasoning_parser: str | None, tool_call_parser: str | None, enable_thinking: bool = True
    ):
        self.plan = plan
        self._parser = ChatResponseParser(
            reasoning_parser, tool_call_parser if plan.parse_output else None, enable_thinking
        )
        # forced calls: the reasoning parser alone splits off the reasoning; the rest is the call
        self._reasoning = REASONING_PARSERS[reasoning_parser](enable_thinking) if reasoning_parser else None
        self._content = ""  # forced: the constrained text so far
        self._call_id = make_tool_call_id()
        self._named_started = False

    # whole
    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The response message's fields and the choice's finish_reason."""
        if not self.plan.forced and self._reasoning is None and not self.plan.parse_output:
            return self._fields(None, text, ()), finish_reason  # no parser: the text as it is
        if not self.plan.forced:
            parsed = self._parser.parse(text)
            reason = "tool_calls" if parsed.tool_calls else finish_reason
            return self._fields(parsed.reasoning_content, parsed.content, parsed.tool_calls), reason
        reasoning, content = self._reasoning.extract(text) if self._reasoning else (None, text)
        calls = self._forced_calls(content or "")
        if calls is None:  # cut short (max_tokens): the text as it is
            return self._fields(reasoning, content, ()), finish_reason
        return self._fields(reasoning, None, calls), self._forced_reason(finish_reason)

    # streamed
    def delta(self, delta_text: str) -> DeltaMessage | None:
        if not self.plan.forced:
            return self._parser.parse_delta(delta_text)
        piece = self._reasoning.extract_streaming(delta_text) if self._reasoning else DeltaMessage(delta_text)
        return self._forced_delta(piece)

    def finish(self, finish_reason: str | None) -> tuple[DeltaMessage | None, str | None]:
        """What was held back, and the finish_reason of the last chunk."""
        if not self.plan.forced:
            tail = self._parser.finish()
            return tail, "tool_calls" if self._parser.tools_called else finish_reason
        tail = self._forced_delta(self._reasoning.finish() if self._reasoning else None)
        if self.plan.named is not None:
            return tail, finish_reason
        calls = self._forced_calls(self._content)
        if calls is None:
            return _merge(tail, DeltaMessage(content=self._content or None)), finish_reason
        deltas = tuple(DeltaToolCall(index=i, id=c.id, name=c.name, arguments=c.arguments) for i, c in enumerate(calls))
        return _merge(tail, DeltaMessage(tool_calls=deltas)), self._forced_reason(finish_reason)

    def _forced_delta(self, piece: DeltaMessage | None) -> DeltaMessage | None:
        """Reasoning passes; the constrained text streams as the named call's arguments, or
        is held back for "required" (its calls are known only at the end)."""
        if piece is None:
            return None
        reasoning, content = piece.reasoning_content, piece.content or ""
        self._content += content
        calls: tuple[DeltaToolCall, ...] = ()
        if content and self.plan.named is not None:
            first = not self._named_started
            self._named_started = True
            calls = (
                DeltaToolCall(
                    index=0,
                    id=self._call_id if first else None,
                    name=self.plan.named if first else None,
                    arguments=content,
                ),
            )
        if reasoning is None and not calls:
            return None
        return DeltaMessage(reasoning_content=reasoning, tool_calls=calls)

    def _forced_calls(self, content: str) -> tuple[ToolCall, ...] | None:
        try:
            calls = forced_tool_calls(self._tool_choice, content)
            if self.plan.named is None:
                json.loads(content)  # "required": the whole array must be there
        except (json.JSONDecodeError, KeyError, TypeError):
            logger.info("the constrained tool-call output is incomplete; returned as content")
            return None
        return tuple(ToolCall(c.name, c.arguments, self._call_id if i == 0 else c.id) for i, c in enumerate(calls))

    @property
    def _tool_choice(self):
        return {"type": "function", "function": {"name": self.plan.named}} if self.plan.named else "required"

    def _forced_reason(self, finish_reason: str | None) -> str | None:
        return "tool_calls" if self.plan.named is None and finish_reason == "stop" else finish_reason

    @staticmethod
    def _fields(reasoning: str | None, content: str | None, calls) -> dict:
        return {"content": content, "reasoning_content": reasoning, "tool_calls": [c.to_dict() for c in calls]}


def _merge(a: DeltaMessage | None, b: DeltaMessage | None) -> DeltaMessage | None:
    if a is None or b is None:
        return a or b
    content = (a.content or "") + (b.content or "")
    return DeltaMessage(
        content=content or None, reasoning_content=a.reasoning_content, tool_calls=a.tool_calls + b.tool_calls
    )
