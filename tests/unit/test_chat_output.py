"""One chat choice's output: forced tool calls ("required", named) whole and streamed, and
the finish reasons vLLM gives them."""

import json

from atom.entrypoints.openai.chat_output import ChoiceOutput
from atom.entrypoints.openai.structured_request import ToolPlan
from atom.sampling_params import StructuredOutputsParams

CALLS = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, {"name": "t", "parameters": {}}]'
ARGS = '{"city": "Paris", "unit": "celsius"}'


def plan(named=None) -> ToolPlan:
    return ToolPlan([{}], "named" if named else "required", named, StructuredOutputsParams(json={}))


def pieces(text, size=7):
    return [text[i : i + size] for i in range(0, len(text), size)]


def test_required_whole_and_streamed_agree():
    fields, reason = ChoiceOutput(plan(), None, None).message(CALLS, "stop")
    assert reason == "tool_calls" and fields["content"] is None
    whole = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in fields["tool_calls"]]
    out = ChoiceOutput(plan(), None, None)
    assert all(out.delta(p) is None for p in pieces(CALLS))  # held back: the calls are known at the end
    tail, reason = out.finish("stop")
    assert reason == "tool_calls"
    assert [(d.name, json.loads(d.arguments)) for d in tail.tool_calls] == whole
    assert [d.index for d in tail.tool_calls] == [0, 1] and all(d.id for d in tail.tool_calls)


def test_named_streams_its_arguments_and_keeps_stop():
    out = ChoiceOutput(plan("get_weather"), None, None)
    deltas = [out.delta(p) for p in pieces(ARGS)]
    first = deltas[0].tool_calls[0]
    assert first.id and first.name == "get_weather" and all(d.tool_calls[0].id is None for d in deltas[1:])
    assert "".join(d.tool_calls[0].arguments for d in deltas) == ARGS
    assert out.finish("stop") == (None, "stop")
    fields, reason = ChoiceOutput(plan("get_weather"), None, None).message(ARGS, "stop")
    assert reason == "stop" and fields["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ARGS}


def test_cut_short_is_content_not_a_broken_call():
    fields, reason = ChoiceOutput(plan(), None, None).message(CALLS[:20], "length")
    assert (fields["content"], fields["tool_calls"], reason) == (CALLS[:20], [], "length")


def test_reasoning_before_a_forced_call():
    out = ChoiceOutput(plan("get_weather"), "qwen3", None)
    fields, _ = out.message(f"<think>rain?</think>{ARGS}", "stop")
    assert fields["reasoning_content"] == "rain?" and fields["tool_calls"][0]["function"]["arguments"] == ARGS
