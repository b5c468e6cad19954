"""What a request constrains its output to, from its fields (OpenAI's ``response_format``,
vLLM's ``structured_outputs`` and older ``guided_*``, and ``tool_choice`` "required" or a named
function), checked here so that a bad constraint is a 400 naming the field, never an error
inside the engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from atom.entrypoints.openai.protocol import ChatCompletionRequest, SamplingRequest
from atom.entrypoints.openai.serving_engine import OpenAIError
from atom.entrypoints.openai.tool_parsers import TOOL_PARSERS, tool_choice_json_schema
from atom.sampling_params import StructuredOutputsParams
from atom.structured_output import GrammarSpec


def structured_outputs(request: SamplingRequest) -> StructuredOutputsParams | None:
    """The request's one constraint (None when it has none); a 400 if it gives several or
    one the grammar engine cannot enforce."""
    given = _given(request)
    if len(given) > 1:
        raise OpenAIError(
            f"give one structured output constraint, not several: {', '.join(given)}", param=next(iter(given))
        )
    if not given:
        return None
    [(param, params)] = given.items()
    check(params, param)
    return params


def check(params: StructuredOutputsParams, param: str) -> None:
    try:
        GrammarSpec.from_params(params).validate()
    except ValueError as e:
        raise OpenAIError(str(e), param=param) from e


def _given(request: SamplingRequest) -> dict[str, StructuredOutputsParams]:
    given: dict[str, StructuredOutputsParams] = {}
    try:
        if request.response_format is not None:
            spec = GrammarSpec.from_response_format(request.response_format)
            if spec is not None:
                schema = request.response_format.get("json_schema", {}).get("schema")
                given["response_format"] = (
                    StructuredOutputsParams(json_object=True)
                    if spec.kind == "json_object"
                    else StructuredOutputsParams(json=schema)
                )
    except (ValueError, AttributeError) as e:
        raise OpenAIError(f"response_format: {e}", param="response_format") from e
    so = request.structured_outputs
    constrains = so is not None and any(
        v is not None for v in (so.json_, so.regex, so.choice, so.grammar, so.json_object)
    )
    if constrains:
        given["structured_outputs"] = _params(
            "structured_outputs",
            json=so.json_,
            regex=so.regex,
            choice=so.choice,
            grammar=so.grammar,
            json_object=so.json_object or None,
            disable_any_whitespace=so.disable_any_whitespace,
        )
    for name, field in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        if getattr(request, name) is not None:
            given[name] = _params(name, **{field: getattr(request, name)})
    if so is not None and not constrains and so.disable_any_whitespace:
        # an option alone (vLLM's disable_any_whitespace) applies to the constraint given elsewhere
        given = {k: dataclasses.replace(v, disable_any_whitespace=True) for k, v in given.items()}
    return given


def _params(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:
        raise OpenAIError(f"{param}: {e}", param=param) from e


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How a chat request uses its tools: ``tool_choice`` resolved ("none", "auto", "required"
    or the named function's name), the constraint "required"/named put on the output, and
    whether the output goes through the tool-call parser ("auto")."""

    tools: list[dict[str, Any]] | None
    choice: str
    named: str | None
    constraint: StructuredOutputsParams | None

    @property
    def parse_output(self) -> bool:
        return self.choice == "auto"

    @property
    def forced(self) -> bool:
        return self.constraint is not None


def tool_plan(request: ChatCompletionRequest, tool_call_parser: str | None, auto_enabled: bool) -> ToolPlan:
    """vLLM's checks: tools need a choice they can serve, "auto" needs the server's
    ``--enable-auto-tool-choice --tool-call-parser``, a named function must be in tools."""
    # the entries as sent (checked by their model): the chat template sees the client's keys
    tools = None if request.tools is None else [t.model_dump(exclude_unset=True) for t in request.tools]
    choice = request.tool_choice
    if tools is not None and not tools:
        raise OpenAIError("tools must not be an empty list", param="tools")
    if choice not in (None, "none") and not tools:
        raise OpenAIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if tools and choice is None:
        choice = "auto"  # as OpenAI and vLLM default
    if choice == "auto" and not (auto_enabled and tool_call_parser in TOOL_PARSERS):
        raise OpenAIError(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            param="tool_choice",
        )
    try:
        schema = tool_choice_json_schema(choice, tools, request.parallel_tool_calls)
    except ValueError as e:
        raise OpenAIError(str(e), param="tool_choice" if "tool_choice" in str(e) else "tools") from e
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    constraint = None
    if schema is not None:
        so = request.structured_outputs
        constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=bool(so and so.disable_any_whitespace))
        check(constraint, "tools")
    return ToolPlan(tools, "named" if named else (choice or "none"), named, constraint)
