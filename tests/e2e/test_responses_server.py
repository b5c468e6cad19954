"""The Responses API (``/v1/responses``) through a real server and the real ``openai`` client, on a tiny
random checkpoint: the same text, prompt and limits as the chat endpoint for the same conversation, the
stream of events, input items (function calls and their outputs, reasoning), tools, ``text.format``,
logprobs, the store (``VLLM_ENABLE_RESPONSES_API_STORE=1``) and the 4xx of bad requests.

The main server renders every message field in its chat template (``--chat-template``), so that a prompt's
token count shows whether an input item reached it; a second one runs ``--reasoning-parser qwen3`` with the
store off.
"""

from __future__ import annotations

import json
import os

import openai
import pytest
from openai.types.responses.response import IncompleteDetails
from server_process import ServerProcess

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning %}<think>{{ m.reasoning }}</think>{% endif %}"
    "{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]"
    "{% endif %}<|im_end|>\n{% endfor %}{% for t in tools or [] %}{{ t.function.name }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": CITY}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = ServerProcess(tiny_model, tmp_path_factory.mktemp("responses"),
                        extra_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                    "--chat-template", TEMPLATE),
                        env={**os.environ, "VLLM_ENABLE_RESPONSES_API_STORE": "1"})  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=600)


def rendered_tokens(server: ServerProcess, text: str) -> int:
    return server.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()["count"]


@pytest.mark.parametrize("finished", [False, True])
def test_text_and_usage_are_the_chat_endpoints(client, tiny_model, finished):
    # the random model never stops on its own: a choice makes it (status "completed"), else max_output_tokens
    extra = {"structured_outputs": {"choice": ["Once upon a time."]}} if finished else {}
    kwargs = dict(model=tiny_model, temperature=0, extra_body=extra)
    resp = client.responses.create(input="Tell me a story.", instructions="Be brief.", max_output_tokens=30, **kwargs)
    chat = client.chat.completions.create(messages=[{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Tell me a story."}],
                                          max_completion_tokens=30, **kwargs)  # fmt: skip
    assert resp.output_text == chat.choices[0].message.content
    assert [o.type for o in resp.output] == ["message"]
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                   chat.usage.completion_tokens)
    assert chat.choices[0].finish_reason == ("stop" if finished else "length")
    assert resp.status == ("completed" if finished else "incomplete")
    assert resp.output[0].status == resp.status
    assert resp.incomplete_details == (None if finished else IncompleteDetails(reason="max_output_tokens"))
    assert resp.instructions == "Be brief." and resp.max_output_tokens == 30


def test_stream_of_events(client, tiny_model):
    whole = client.responses.create(model=tiny_model, input="Hello", max_output_tokens=10, temperature=0)
    events = list(client.responses.create(model=tiny_model, input="Hello", max_output_tokens=10, temperature=0,
                                          stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.output[0].id == events[2].item.id == events[-2].item.id
    assert events[-1].response.usage.output_tokens == 10 and events[0].response.status == "in_progress"


def test_streamed_text_deltas_carry_their_tokens_logprobs(client, tiny_model):
    # as vLLM: each output_text delta has the logprobs of the tokens it adds; together, the final message's
    kwargs = dict(model=tiny_model, input="Hello", max_output_tokens=12, temperature=0, top_logprobs=2,
                  include=["message.output_text.logprobs"])  # fmt: skip
    events = list(client.responses.create(**kwargs, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response.output[0].content[0].logprobs
    streamed = [lp for e in deltas for lp in e.logprobs]

    def key(lp):  # the delta event's fields (the final message's have bytes too)
        return lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs]

    assert len(final) == 12 and list(map(key, streamed)) == list(map(key, final))
    assert all(len(lp.top_logprobs) == 2 for lp in streamed)
    assert "bytes" not in deltas[0].model_dump()["logprobs"][0]  # OpenAI's delta schema
    plain = client.responses.create(**{**kwargs, "include": None}, stream=True)
    assert all(e.logprobs == [] for e in plain if e.type == "response.output_text.delta")


def test_input_items_reach_the_template(server, client, tiny_model):
    """Developer messages as system, a function call joined to the assistant turn before it, its output as
    a tool message, a reasoning item on the next assistant turn: the prompt is that conversation's."""
    items = [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"role": "assistant", "content": "Checking."},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "user", "content": "And so?"},
    ]
    resp = client.responses.create(model=tiny_model, input=items, max_output_tokens=1, temperature=0)
    expected = ("<|im_start|>system\nUse tools.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                "<|im_start|>assistant\n<think>Call it.</think>Checking.<tool_call>call_1 get_weather "
                '{"city": "Paris"}</tool_call><|im_end|>\n<|im_start|>tool\nsunny[call_1]<|im_end|>\n'
                "<|im_start|>user\nAnd so?<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
    assert resp.usage.input_tokens == rendered_tokens(server, expected)


def test_previous_response_id_and_retrieve(server, client, tiny_model):
    first = client.responses.create(model=tiny_model, input="Hi", max_output_tokens=5, temperature=0)
    assert first.store and client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(model=tiny_model, input="More", previous_response_id=first.id,
                                     max_output_tokens=1, temperature=0)  # fmt: skip
    expected = (f"<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n{first.output_text}<|im_end|>\n"
                "<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
    assert second.usage.input_tokens == rendered_tokens(server, expected)
    assert second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=tiny_model, input="x", previous_response_id="resp_nope")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_call_and_its_round_trip(client, tiny_model, stream):
    # the random model may write whitespace for long between JSON tokens: room for it
    kwargs = dict(model=tiny_model, input="Weather?", tools=[WEATHER], temperature=0, max_output_tokens=300,
                  tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    if stream:
        events = list(client.responses.create(**kwargs, stream=True))
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1 and done[0].name == "get_weather"
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert deltas == done[0].arguments
        resp = events[-1].response
    else:
        resp = client.responses.create(**kwargs)
    [call] = resp.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert resp.tools[0].name == "get_weather" and resp.tool_choice.name == "get_weather"
    back = [{"role": "user", "content": "Weather?"}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]  # fmt: skip
    assert client.responses.create(model=tiny_model, input=back, max_output_tokens=2).status == "incomplete"


def test_text_format_json_schema_and_logprobs(client, tiny_model):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY}
    resp = client.responses.create(model=tiny_model, input="City?", text={"format": fmt}, max_output_tokens=300,
                                   temperature=0, include=["message.output_text.logprobs"], top_logprobs=2)  # fmt: skip
    assert json.loads(resp.output_text)["city"] in ("Paris", "Rome")
    logprobs = resp.output[0].content[0].logprobs
    assert len(logprobs) == resp.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"input": "x", "background": True}, 400, "background", "background"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, 400, "input",
         "content[0].type"),
        ({"input": "x", "tool_choice": "required"}, 400, "tool_choice", "`tools` must be set"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools", "function"),
        ({"input": "x", "max_output_tokens": 10**6}, 400, "max_output_tokens", "maximum context length"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, 400, "text", "schema"),
        ({"input": "x", "model": "nope"}, 404, "model", "does not exist"),
    ],
)
def test_bad_requests(server, body, status, param, words):
    r = server.post("/v1/responses", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_reasoning_items_and_no_store(tiny_model, tmp_path):
    srv = ServerProcess(tiny_model, tmp_path, extra_args=("--reasoning-parser", "qwen3"))
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0, timeout=600)
        kwargs = dict(model=tiny_model, input="Weather?", max_output_tokens=200, temperature=0,
                      extra_body={"structured_outputs": {"choice": ["<think>Paris is in France.</think>Sunny."]}})
        resp = client.responses.create(**kwargs)
        assert [o.type for o in resp.output] == ["reasoning", "message"]
        assert resp.output[0].content[0].text == "Paris is in France." and resp.output_text == "Sunny."
        assert 0 < resp.usage.output_tokens_details.reasoning_tokens < resp.usage.output_tokens
        events = list(client.responses.create(**kwargs, stream=True))
        reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert reasoning == "Paris is in France."
        assert events[-1].response.model_dump(exclude={"id", "created_at", "output"}) == resp.model_dump(
            exclude={"id", "created_at", "output"})
        assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]
        # the SDK's stream helper accumulates the same events (it checks the items' and response's ids)
        with client.responses.stream(**kwargs) as stream:
            assert stream.get_final_response().output_text == "Sunny."
        assert not resp.store  # the store is off: nothing to continue from
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model=tiny_model, input="x", previous_response_id=resp.id)
    finally:
        srv.stop()
