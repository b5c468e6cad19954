"""Structured output, tool calls and reasoning through a real server, sent by the real
``openai`` client, on a tiny random checkpoint: the grammar alone makes its output valid.

One server (``--enable-auto-tool-choice --tool-call-parser hermes``) for the module, and one
with ``--reasoning-parser qwen3``. The tiny model's random output never closes a JSON string
on its own, so the schemas bound their strings (``atom.testing.json_schemas``); a forced
tool call's text comes from a ``guided_choice``.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema_rs
import openai
import pytest
from server_process import ServerProcess

from atom.testing.json_schemas import SCHEMAS

MAX_TOKENS = 300
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = ServerProcess(
        tiny_model,
        tmp_path_factory.mktemp("so-server"),
        extra_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--trust-request-chat-template"),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=600)


def valid(schema: dict, text: str) -> None:
    jsonschema_rs.validator_for(schema, validate_formats=True).validate(json.loads(text))


def test_response_format_json_schema_on_every_schema(client, tiny_model):
    def ask(i: int):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}
        # a random model spends its tokens on the free whitespace: most of these leave it out
        extra = {"structured_outputs": {"disable_any_whitespace": True}} if i % 4 else None
        return client.chat.completions.create(
            model=tiny_model,
            messages=[{"role": "user", "content": f"JSON {i}"}],
            response_format=fmt,
            max_tokens=MAX_TOKENS,
            extra_body=extra,
            temperature=0 if i % 2 == 0 else 0.8,
            seed=i,
        )

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # all at once: one batch, one bitmask per step
        responses = list(pool.map(ask, range(len(SCHEMAS))))
    for schema, response in zip(SCHEMAS, responses):
        choice = response.choices[0]
        assert choice.finish_reason == "stop"
        valid(schema, choice.message.content)


def test_completions_guided_fields_streamed_and_not(client, tiny_model):
    schema = SCHEMAS[2]
    out = client.completions.create(
        model=tiny_model,
        prompt="n =",
        max_tokens=MAX_TOKENS,
        temperature=0.7,
        seed=1,
        n=2,
        extra_body={"guided_json": schema},
    )
    for choice in out.choices:
        valid(schema, choice.text)
    stream = client.completions.create(
        model=tiny_model,
        prompt="pick",
        max_tokens=20,
        temperature=0,
        stream=True,
        extra_body={"guided_choice": ["alpha", "beta"]},
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) in ("alpha", "beta")
    out = client.completions.create(
        model=tiny_model,
        prompt="code",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{3}"}},
    )
    text = out.choices[0].text
    assert len(text) == 5 and text[:2].isupper() and text[2:].isdigit()
    out = client.completions.create(
        model=tiny_model,
        prompt="sum",
        max_tokens=40,
        temperature=0,
        extra_body={"guided_grammar": 'root ::= [1-9] (" + " [1-9])*'},
    )
    assert all(part.strip().isdigit() for part in out.choices[0].text.split("+"))


def test_chat_stream_with_json_schema(client, tiny_model):
    schema = SCHEMAS[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}
    stream = client.chat.completions.create(
        model=tiny_model, messages=MESSAGES, response_format=fmt, stream=True, max_tokens=MAX_TOKENS, temperature=0
    )
    chunks = list(stream)
    valid(schema, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "integer", "multipleOf": 3}},
                }
            },
            "response_format",
            "multipleOf",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "Invalid regex"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex", "not several"),
        ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
        ({"functions": [{"name": "f"}]}, None, "functions is not supported"),
        ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        ({"tools": []}, "tools", "empty"),
        # malformed entries are refused whatever tool_choice says, naming the entry's field
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "abc"}}], "tool_choice": "none"},
            "tools",
            "tools[0].function.parameters: Input should be a valid dictionary",
        ),
        (
            {"tools": [WEATHER, {"function": {"description": "no name"}}]},
            "tools",
            "tools[1].function.name: Field required",
        ),
        (
            {"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
            "tools",
            "tools[0].type: Input should be 'function'",
        ),
    ],
)
def test_unsupported_or_bad_fields_are_400(client, tiny_model, extra, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=tiny_model, messages=MESSAGES, max_tokens=5, extra_body=extra)
    assert words in str(err.value)
    if param is not None:
        assert err.value.body["param"] == param


def test_tool_choice_required_and_named(client, tiny_model):
    # a random model would add calls (and blank space) forever: one call, no free whitespace
    out = client.chat.completions.create(
        model=tiny_model,
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        temperature=0,
        parallel_tool_calls=False,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time") and call.id
        params = WEATHER if call.function.name == "get_weather" else TIME
        valid(params["function"]["parameters"], call.function.arguments)
    out = client.chat.completions.create(
        model=tiny_model,
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        temperature=0.5,
        seed=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS,
    )
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and out.choices[0].message.content is None
    valid(WEATHER["function"]["parameters"], call.function.arguments)


def streamed_calls(chunks) -> tuple[dict[int, dict], str | None]:
    """The tool calls a client rebuilds from the deltas (OpenAI's way), and the finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or delta.id
                call["name"] += delta.function.name or "" if delta.function else ""
                call["arguments"] += delta.function.arguments or "" if delta.function else ""
    return calls, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_stream(client, tiny_model, tool_choice):
    chunks = client.chat.completions.create(
        model=tiny_model,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice=tool_choice,
        stream=True,
        max_tokens=MAX_TOKENS,
        temperature=0,
        parallel_tool_calls=False,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    calls, finish = streamed_calls(chunks)
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"]
    valid(WEATHER["function"]["parameters"], calls[0]["arguments"])
    assert finish == ("tool_calls" if tool_choice == "required" else "stop")


def test_auto_parses_the_models_hermes_call(client, tiny_model):
    # the tiny model cannot choose to call a tool: a guided_choice makes it write the call
    extra = {"guided_choice": [HERMES_CALL]}
    out = client.chat.completions.create(
        model=tiny_model,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice="auto",
        max_tokens=200,
        temperature=0,
        extra_body=extra,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris", "unit": "celsius"},
    )
    chunks = client.chat.completions.create(
        model=tiny_model,
        messages=MESSAGES,
        tools=[WEATHER],
        max_tokens=200,
        temperature=0,
        extra_body=extra,
        stream=True,
    )
    calls, finish = streamed_calls(chunks)
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "celsius"}


def test_auto_without_a_call_is_plain_content(client, tiny_model):
    out = client.chat.completions.create(
        model=tiny_model,
        messages=MESSAGES,
        tools=[WEATHER],
        max_tokens=60,
        temperature=0,
        extra_body={"guided_choice": ["It is sunny."]},
    )
    assert out.choices[0].message.content == "It is sunny." and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"


# the tiny checkpoint's template with the tools' names after the messages (its own leaves tools out)
TOOLS_TEMPLATE = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                  "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}")


def prompt_tokens(srv: ServerProcess, client: openai.OpenAI, tiny_model: str, **tools) -> tuple[int, int]:
    """The prompt's tokens as /tokenize renders it, and as a chat completion with ``tools`` counts them."""
    body = {"messages": MESSAGES, "chat_template": TOOLS_TEMPLATE}
    tokenized = srv.post("/tokenize", {**body, **({"tools": tools["tools"]} if tools else {})})
    chat = client.chat.completions.create(model=tiny_model, messages=MESSAGES, max_tokens=1,
                                          extra_body={"chat_template": TOOLS_TEMPLATE}, **tools)  # fmt: skip
    return tokenized.json()["count"], chat.usage.prompt_tokens


def test_tool_choice_none_shows_the_tools(server, client, tiny_model):
    """As vLLM: the prompt has the tools with tool_choice "none" too, and /tokenize with tools renders the
    prompt the chat endpoint does."""
    bare, _ = prompt_tokens(server, client, tiny_model)
    tokenized, chat = prompt_tokens(server, client, tiny_model, tools=[WEATHER], tool_choice="none")
    assert tokenized == chat > bare


def test_reasoning_parser_splits_reasoning_content(tiny_model, tmp_path):
    # with --exclude-tools-when-tool-choice-none too (one server fewer): tool_choice "none" hides the tools
    flags = ("--reasoning-parser", "qwen3", "--trust-request-chat-template", "--exclude-tools-when-tool-choice-none")
    srv = ServerProcess(tiny_model, tmp_path, extra_args=flags)
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0, timeout=600)
        bare, _ = prompt_tokens(srv, client, tiny_model)
        assert prompt_tokens(srv, client, tiny_model, tools=[WEATHER], tool_choice="none")[1] == bare
        # the tiny vocabulary has no <think> token, so the grammar covers the whole output
        extra = {"guided_choice": ["<think>Paris is in France.</think>It is sunny."]}
        out = client.chat.completions.create(
            model=tiny_model, messages=MESSAGES, max_tokens=200, temperature=0, extra_body=extra
        )
        message = out.choices[0].message
        assert (message.reasoning_content, message.content) == ("Paris is in France.", "It is sunny.")
        assert message.reasoning == message.reasoning_content  # vLLM's name (0.26 on) too
        chunks = list(
            client.chat.completions.create(
                model=tiny_model, messages=MESSAGES, max_tokens=200, temperature=0, extra_body=extra, stream=True
            )
        )
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        for name in ("reasoning_content", "reasoning"):
            assert "".join(getattr(d, name, None) or "" for d in deltas) == "Paris is in France."
        assert "".join(d.content or "" for d in deltas) == "It is sunny."
    finally:
        srv.stop()
