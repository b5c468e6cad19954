"""Tool calls in model output, as vLLM's ``--tool-call-parser hermes`` reads them, and the
JSON schema that structured output enforces for ``tool_choice`` "required" or a named function.

The hermes format (Qwen2.5/Qwen3, SmolLM2, Hermes chat templates)::

    Some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from atom.entrypoints.openai.parsed_output import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    make_tool_call_id,
    partial_tag_overlap,
)

logger = logging.getLogger(__name__)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


class HermesToolParser:
    """Parses one response: ``extract`` a whole output, or feed ``extract_streaming`` each new
    piece of text (one parser per streamed response)."""

    def __init__(self) -> None:
        self._text = ""
        self._sent_content = 0  # characters of content streamed
        self._names: list[str] = []  # per call whose name was streamed
        self._sent_arguments: list[str] = []  # per call, the argument text streamed so far

    def extract(self, output: str) -> ExtractedToolCalls:
        if TOOL_CALL_START not in output:
            return ExtractedToolCalls(False, (), output)
        try:
            calls = [json.loads(closed or unclosed) for closed, unclosed in _CALL.findall(output)]
            tool_calls = tuple(
                ToolCall(
                    name=call["name"],
                    arguments=json.dumps(call["arguments"], ensure_ascii=False),
                    id=make_tool_call_id(),
                )
                for call in calls
            )
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            logger.warning("Output holds %s but no valid tool call (%s); returned as content", TOOL_CALL_START, error)
            return ExtractedToolCalls(False, (), output)
        content = output[: output.find(TOOL_CALL_START)]
        return ExtractedToolCalls(True, tool_calls, content or None)

    def extract_streaming(self, delta_text: str) -> DeltaMessage | None:
        """The new content and tool-call pieces once ``delta_text`` is appended (None: nothing to
        send yet). Text after the first call is not content; a partial tag is held back."""
        self._text += delta_text
        content = self._new_content()
        deltas: list[DeltaToolCall] = []
        for index, (body, complete) in enumerate(self._call_bodies()):
            if index == len(self._names):
                name = _NAME.search(body)
                if name is None:
                    break  # the calls stream in order: wait for this one's name
                self._names.append(name.group(1))
                self._sent_arguments.append("")
                deltas.append(DeltaToolCall(index=index, id=make_tool_call_id(), name=name.group(1)))
            arguments = self._new_arguments(index, body, complete)
            if arguments:
                deltas.append(DeltaToolCall(index=index, arguments=arguments))
        if content or deltas:
            return DeltaMessage(content=content or None, tool_calls=tuple(deltas))
        return None

    def finish(self) -> DeltaMessage | None:
        """At the end of the stream: content held back as a possible partial tag that never
        completed (text after a tool call is not content, as in ``extract``)."""
        if TOOL_CALL_START in self._text or self._sent_content >= len(self._text):
            return None
        content, self._sent_content = self._text[self._sent_content :], len(self._text)
        return DeltaMessage(content=content)

    @property
    def tools_called(self) -> bool:
        """Whether the stream so far started a tool call (finish_reason "tool_calls")."""
        return bool(self._names)

    def _new_content(self) -> str:
        start = self._text.find(TOOL_CALL_START)
        end = start if start >= 0 else len(self._text) - partial_tag_overlap(self._text, TOOL_CALL_START)
        if end <= self._sent_content:
            return ""
        content, self._sent_content = self._text[self._sent_content : end], end
        return content

    def _call_bodies(self) -> list[tuple[str, bool]]:
        """(JSON text, complete) of each call so far; the last may still be growing."""
        bodies, pos = [], 0
        while (start := self._text.find(TOOL_CALL_START, pos)) >= 0:
            body_start = start + len(TOOL_CALL_START)
            end = self._text.find(TOOL_CALL_END, body_start)
            if end >= 0:
                bodies.append((self._text[body_start:end].strip(), True))
                pos = end + len(TOOL_CALL_END)
                continue
            body = self._text[body_start:]
            body = body[: len(body) - partial_tag_overlap(body, TOOL_CALL_END)].strip()
            bodies.append((body, bool(body) and _is_json(body)))  # complete JSON: only the tag is missing
            break
        return bodies

    def _new_arguments(self, index: int, body: str, complete: bool) -> str:
        match = _ARGUMENTS.search(body)
        if match is None:
            return ""
        arguments = body[match.end() :]
        if complete:  # drop the brace closing the call object, not part of the arguments
            arguments = arguments.rstrip()
            arguments = arguments[:-1].rstrip() if arguments.endswith("}") else arguments
        sent = self._sent_arguments[index]
        if len(arguments) <= len(sent):
            return ""
        self._sent_arguments[index] = arguments
        return arguments[len(sent) :]


TOOL_PARSERS = {"hermes": HermesToolParser}


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    if tool.get("type", "function") != "function" or "function" not in tool:
        raise ValueError(f"tools entries must be {{'type': 'function', 'function': {{...}}}}, got {tool!r}")
    return tool["function"]


def _parameters(function: Mapping[str, Any]) -> dict:
    # no parameters still constrains the arguments to a JSON object
    return dict(function.get("parameters") or {"type": "object", "properties": {}})


def tool_choice_json_schema(
    tool_choice: str | Mapping[str, Any] | None,
    tools: Sequence[Mapping[str, Any]] | None,
    parallel_tool_calls: bool | None = None,
) -> dict | None:
    """The schema structured output enforces for ``tool_choice`` (vLLM's): a named function,
    its parameters (the output is that call's arguments); "required", a non-empty array of
    ``{"name": ..., "parameters": ...}``, one item at most when ``parallel_tool_calls`` is
    False; "auto", "none" or no tools: None (the output is free)."""
    if tool_choice in (None, "none", "auto") or not tools:
        return None
    functions = [_function(tool) for tool in tools]
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
        for function in functions:
            if function.get("name") == name:
                return _parameters(function)
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
    if tool_choice != "required":
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}")
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": _parameters(f)},
                    "required": ["name", "parameters"],
                }
                for f in functions
            ],
        },
    }
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    definitions: dict[str, Any] = {}
    for function in functions:  # the items refer to their $defs from the root
        for key, value in (function.get("parameters") or {}).get("$defs", {}).items():
            if definitions.setdefault(key, value) != value:
                raise ValueError(f"tools define $defs {key!r} twice, differently")
    for item in schema["items"]["anyOf"]:
        item["properties"]["parameters"].pop("$defs", None)
    if definitions:
        schema["$defs"] = definitions
    return schema


def forced_tool_calls(tool_choice: str | Mapping[str, Any], output: str) -> tuple[ToolCall, ...]:
    """The tool calls of an output constrained by ``tool_choice_json_schema``."""
    if isinstance(tool_choice, Mapping):
        name = tool_choice["function"]["name"]
        return (ToolCall(name=name, arguments=output.strip(), id=make_tool_call_id()),)
    return tuple(
        ToolCall(
            name=call["name"], arguments=json.dumps(call["parameters"], ensure_ascii=False), id=make_tool_call_id()
        )
        for call in json.loads(output)
    )
