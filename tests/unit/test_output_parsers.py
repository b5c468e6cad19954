"""Tool-call (hermes) and reasoning (qwen3) parsers: whole outputs, and streams cut anywhere
that add up to the same result. Expected values are vLLM 0.32's for the same strings."""

import json
import random

import jsonschema_rs
import pytest

from atom.entrypoints.openai.reasoning_parsers import Qwen3ReasoningParser
from atom.entrypoints.openai.tool_parsers import HermesToolParser, forced_tool_calls, tool_choice_json_schema

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}

REASONING_CASES = [
    ("<think>plan it</think>\n\nThe answer.", ("plan it", "\n\nThe answer.")),
    ("plan it</think>The answer.", ("plan it", "The answer.")),  # <think> was in the prompt
    ("<think>still thinking", ("still thinking", None)),
    ("no tags at all", ("no tags at all", None)),
    ("<think></think>Answer", (None, "Answer")),
    ("<think>a</think>b</think>c", ("a", "bc")),
    ('<think>x<tool_call>{"name": "f"}</tool_call>', ("x", '<tool_call>{"name": "f"}</tool_call>')),
    ("<think>\nhm\n</think>\n\n", ("\nhm\n", "\n\n")),
    ("a < b and c </ d</think>so <thin", ("a < b and c </ d", "so <thin")),
]


def pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("output, expected", REASONING_CASES)
def test_qwen3_reasoning_whole_and_streamed(output, expected):
    assert Qwen3ReasoningParser().extract(output) == expected
    for seed in range(20):
        parser = Qwen3ReasoningParser()
        reasoning = content = ""
        deltas = [parser.extract_streaming(p) for p in pieces(output, random.Random(seed))] + [parser.finish()]
        for delta in filter(None, deltas):
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
            assert "<think>" not in (delta.reasoning_content or "")
        assert (reasoning or None, content or None) == expected


def test_qwen3_reasoning_streams_as_it_goes_and_holds_back_partial_tags():
    parser = Qwen3ReasoningParser()
    assert parser.extract_streaming("<thi") is None
    assert parser.extract_streaming("nk>Let me").reasoning_content == "Let me"
    assert parser.extract_streaming(" see</th").reasoning_content == " see"
    assert not parser.reasoning_ended
    assert parser.extract_streaming("ink>") is None
    assert parser.reasoning_ended
    assert parser.extract_streaming("Paris.").to_dict() == {"content": "Paris."}


def test_qwen3_with_thinking_off_is_all_content():
    parser = Qwen3ReasoningParser(enable_thinking=False)
    assert parser.extract("<think>a</think>b") == (None, "<think>a</think>b")
    assert parser.extract_streaming("<think>a").content == "<think>a"


def collect_stream(output: str, rng: random.Random):
    parser = HermesToolParser()
    content, calls = "", {}
    for piece in pieces(output, rng):
        delta = parser.extract_streaming(piece)
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls:
            if call.id is not None:
                assert call.index not in calls and call.name
                calls[call.index] = {"id": call.id, "name": call.name, "arguments": ""}
            calls[call.index]["arguments"] += call.arguments or ""
    return content or None, [calls[i] for i in sorted(calls)], parser.tools_called


HERMES_CASES = [
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Köln", "unit": "c"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Köln", "unit": "c"}), ("get_time", {})],
    ),
    ('<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}', None, [("get_time", {"tz": "UTC"})]),  # unclosed
]


@pytest.mark.parametrize("output, content, calls", HERMES_CASES)
def test_hermes_tool_calls_whole_and_streamed(output, content, calls):
    extracted = HermesToolParser().extract(output)
    assert extracted.tools_called and extracted.content == content
    assert [(c.name, json.loads(c.arguments)) for c in extracted.tool_calls] == calls
    assert all(c.id.startswith("chatcmpl-tool-") for c in extracted.tool_calls)
    for seed in range(20):
        streamed_content, streamed_calls, called = collect_stream(output, random.Random(seed))
        assert called and streamed_content == content
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls] == calls


def test_hermes_plain_text_and_broken_calls_are_content():
    assert HermesToolParser().extract("Sunny, 20 degrees.").content == "Sunny, 20 degrees."
    broken = "<tool_call>{not json}</tool_call>"
    extracted = HermesToolParser().extract(broken)
    assert not extracted.tools_called and extracted.content == broken
    content, calls, called = collect_stream("It is 3 < 4, <b>ok</b>", random.Random(0))
    assert (content, calls, called) == ("It is 3 < 4, <b>ok</b>", [], False)


def test_hermes_stream_deltas_have_openai_shape():
    parser = HermesToolParser()
    first = parser.extract_streaming('<tool_call>{"name": "get_weather", "arguments": {"ci')
    name, args = first.tool_calls
    assert name.to_dict()["function"] == {"name": "get_weather"} and name.to_dict()["type"] == "function"
    assert args.to_dict() == {"index": 0, "function": {"arguments": '{"ci'}}
    assert parser.extract_streaming('ty": "Paris"}}</tool_call>').tool_calls[0].arguments == 'ty": "Paris"}'


def test_tool_choice_schemas():
    assert tool_choice_json_schema("auto", [WEATHER]) is None
    assert tool_choice_json_schema("none", [WEATHER]) is None
    assert tool_choice_json_schema("required", None) is None
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_choice_json_schema(named, [WEATHER, TIME]) == WEATHER["function"]["parameters"]
    assert tool_choice_json_schema({"type": "function", "function": {"name": "get_time"}}, [TIME]) == {
        "type": "object",
        "properties": {},
    }
    with pytest.raises(ValueError, match="not in tools"):
        tool_choice_json_schema({"type": "function", "function": {"name": "nope"}}, [WEATHER])
    with pytest.raises(ValueError, match="tool_choice must be"):
        tool_choice_json_schema("sometimes", [WEATHER])

    required = jsonschema_rs.validator_for(tool_choice_json_schema("required", [WEATHER, TIME]))
    output = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    assert required.is_valid(json.loads(output))
    assert not required.is_valid([])
    assert not required.is_valid([{"name": "get_weather", "parameters": {}}])  # city is required
    assert not required.is_valid([{"name": "launch", "parameters": {}}])
    single = jsonschema_rs.validator_for(
        tool_choice_json_schema("required", [WEATHER, TIME], parallel_tool_calls=False)
    )
    assert not single.is_valid(json.loads(output))

    calls = forced_tool_calls("required", output)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    [call] = forced_tool_calls(named, '{"city": "Rome"}')
    assert call.to_dict()["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


def test_tool_choice_required_schema_hoists_defs():
    tool = {
        "type": "function",
        "function": {
            "name": "plot",
            "parameters": {
                "type": "object",
                "properties": {"p": {"$ref": "#/$defs/pt"}},
                "required": ["p"],
                "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
            },
        },
    }
    schema = tool_choice_json_schema("required", [tool])
    assert "$defs" in schema and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in tool["function"]["parameters"]  # the request's tools are left as they were
    validator = jsonschema_rs.validator_for(schema)
    assert validator.is_valid([{"name": "plot", "parameters": {"p": {"x": 1}}}])
    assert not validator.is_valid([{"name": "plot", "parameters": {"p": {"x": "one"}}}])
