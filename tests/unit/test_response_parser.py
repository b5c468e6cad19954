"""Reasoning and tool calls in one response: whole and streamed agree, for every cut."""

import json
import random

import pytest

from atom.entrypoints.openai.response_parser import ChatResponseParser

OUTPUT = (
    "<think>The user wants weather; call the tool.</think>\n\nChecking."
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def stream(parser: ChatResponseParser, text: str, seed: int) -> dict:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 20))))
    got = {"reasoning": "", "content": "", "calls": {}}
    deltas = [parser.parse_delta(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])] + [parser.finish()]
    for delta in filter(None, deltas):
        got["reasoning"] += delta.reasoning_content or ""
        got["content"] += delta.content or ""
        for call in delta.tool_calls:
            entry = got["calls"].setdefault(call.index, {"name": call.name, "arguments": ""})
            entry["arguments"] += call.arguments or ""
    return got


@pytest.mark.parametrize("seed", range(10))
def test_reasoning_then_tool_call(seed):
    whole = ChatResponseParser("qwen3", "hermes").parse(OUTPUT)
    assert whole.reasoning_content == "The user wants weather; call the tool."
    assert whole.content == "\n\nChecking."
    [call] = whole.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})

    parser = ChatResponseParser("qwen3", "hermes")
    got = stream(parser, OUTPUT, seed)
    assert got["reasoning"] == whole.reasoning_content and got["content"] == whole.content
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert parser.tools_called


def test_parsers_off_and_partial_tags_flushed():
    plain = ChatResponseParser().parse("a <think>b")
    assert (plain.reasoning_content, plain.content, plain.tool_calls) == (None, "a <think>b", ())
    parser = ChatResponseParser(tool_parser="hermes")
    got = stream(parser, "The tag is <tool_", seed=0)
    assert got["content"] == "The tag is <tool_" and not parser.tools_called
    with pytest.raises(ValueError, match="unknown parser 'mistral'"):
        ChatResponseParser(tool_parser="mistral")


def test_the_server_and_the_engine_know_the_same_reasoning_parsers():
    from atom.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from atom.structured_output.reasoning import REASONING_TAGS

    assert set(REASONING_PARSERS) == set(REASONING_TAGS)


def test_deepseek_r1_reasons_until_the_end_tag_its_prompt_opened():
    parser = ChatResponseParser("deepseek_r1", None, enable_thinking=False)  # R1 has no switch
    parsed = parser.parse("First, Paris.</think>Paris.")
    assert (parsed.reasoning_content, parsed.content) == ("First, Paris.", "Paris.")


def test_prompt_closing_the_reasoning_constrains_from_the_start():
    from atom.structured_output.reasoning import prompt_ends_reasoning

    start, end = 7, 8
    assert prompt_ends_reasoning([1, 2, start, 3, end, 4], (start, end))  # Qwen3, thinking off
    assert not prompt_ends_reasoning([1, 2, start, 3], (start, end))  # DeepSeek-R1 opens it
    assert not prompt_ends_reasoning([1, 2, 3], (start, end))  # Qwen3, thinking on
    assert not prompt_ends_reasoning([start, end, 5, start], (start, end))  # an earlier turn's
