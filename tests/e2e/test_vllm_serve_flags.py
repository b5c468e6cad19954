"""vLLM's `vllm serve` flags and chat extensions, end to end through the real server and the
``openai`` client: --max-logprobs, --response-role, --return-tokens-as-token-ids, chat ``echo``
and the default ``max_tokens``."""

from __future__ import annotations

import re

import openai
import pytest
import requests
from server_process import MAX_MODEL_LEN, ServerProcess, assert_serving

MAX_LOGPROBS = 5
ROLE = "bot"
USER = [{"role": "user", "content": "Name a capital city."}]
# the last message is the assistant's, continued: its role is the response's
CONTINUED = [*USER, {"role": "assistant", "content": "The capital is"}]
CONTINUE = dict(add_generation_prompt=False, continue_final_message=True)
TOKEN_ID = re.compile(r"token_id:(\d+)")


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = ServerProcess(tiny_model, tmp_path_factory.mktemp("server"), extra_args=(
        "--max-logprobs", str(MAX_LOGPROBS), "--response-role", ROLE, "--return-tokens-as-token-ids"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=120)


def test_max_logprobs_is_a_400_naming_the_limit(server, client, tiny_model):
    args = dict(model=tiny_model, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(prompt="Hi", logprobs=MAX_LOGPROBS + 1, **args)
    assert info.value.body["param"] == "logprobs"
    assert f"greater than max allowed: {MAX_LOGPROBS}" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(messages=USER, logprobs=True, top_logprobs=MAX_LOGPROBS + 1, **args)
    assert f"greater than max allowed: {MAX_LOGPROBS}" in info.value.body["message"]
    out = client.completions.create(prompt="Hi", logprobs=MAX_LOGPROBS, **args)
    assert all(len(top) >= MAX_LOGPROBS for top in out.choices[0].logprobs.top_logprobs)
    chat = client.chat.completions.create(messages=USER, logprobs=True, top_logprobs=MAX_LOGPROBS, **args)
    assert all(len(e.top_logprobs) == MAX_LOGPROBS for e in chat.choices[0].logprobs.content)
    assert_serving(server)


def test_response_role(client, tiny_model):
    """--response-role for a new turn; the last message's role when it is continued (vLLM's
    get_chat_request_role)."""
    args = dict(model=tiny_model, max_tokens=3)
    assert client.chat.completions.create(messages=USER, **args).choices[0].message.role == ROLE
    chunks = list(client.chat.completions.create(messages=USER, stream=True, **args))
    assert chunks[0].choices[0].delta.role == ROLE
    continued = client.chat.completions.create(messages=CONTINUED, extra_body=CONTINUE, **args)
    assert continued.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(messages=CONTINUED, stream=True, extra_body=CONTINUE, **args))
    assert chunks[0].choices[0].delta.role == "assistant"


def _ids(tokens: list[str]) -> list[int]:
    matches = [TOKEN_ID.fullmatch(t) for t in tokens]
    assert all(matches), tokens
    return [int(m.group(1)) for m in matches]


def test_completion_tokens_as_token_ids(client, tiny_model):
    args = dict(model=tiny_model, prompt="The capital of France is", max_tokens=4, logprobs=2, temperature=0,
                extra_body={"return_token_ids": True})
    out = client.completions.create(**args).choices[0]
    assert _ids(out.logprobs.tokens) == out.token_ids
    assert all(_ids(list(top)) for top in out.logprobs.top_logprobs)
    # offsets count the shown strings, as vLLM's
    lengths = [len(t) for t in out.logprobs.tokens[:-1]]
    assert out.logprobs.text_offset == [sum(lengths[:i]) for i in range(len(out.logprobs.tokens))]
    chunks = list(client.completions.create(stream=True, **args))
    assert [i for c in chunks for i in _ids(c.choices[0].logprobs.tokens)] == out.token_ids
    # the request's field wins over the flag
    plain = client.completions.create(**{**args, "extra_body": {"return_tokens_as_token_ids": False}}).choices[0]
    assert plain.logprobs.tokens and not any(TOKEN_ID.fullmatch(t) for t in plain.logprobs.tokens)
    assert plain.text == out.text


def test_chat_tokens_as_token_ids(client, tiny_model):
    args = dict(model=tiny_model, messages=USER, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                extra_body={"return_token_ids": True})
    out = client.chat.completions.create(**args).choices[0]
    content = out.logprobs.content
    assert _ids([e.token for e in content]) == out.token_ids
    assert all(_ids([t.token for t in e.top_logprobs]) for e in content)
    assert all(t.bytes == list(t.token.encode()) for e in content for t in e.top_logprobs)
    # the chosen token's bytes are its text's (vLLM's)
    # (a token may end inside a character, which the content holds back)
    assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace").startswith(out.message.content)
    chunks = list(client.chat.completions.create(stream=True, **args))
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert _ids(streamed) == out.token_ids
    plain = client.chat.completions.create(**{**args, "extra_body": {"return_tokens_as_token_ids": False}})
    assert not any(TOKEN_ID.fullmatch(e.token) for e in plain.choices[0].logprobs.content)


def test_chat_echo(client, tiny_model):
    """echo: the last message's content first when its role is the response's (streamed: its own
    chunk after the role chunks); otherwise nothing is prepended."""
    args = dict(model=tiny_model, max_tokens=4, temperature=0, n=2)
    plain = client.chat.completions.create(messages=CONTINUED, extra_body=CONTINUE, **args)
    echoed = client.chat.completions.create(messages=CONTINUED, extra_body={**CONTINUE, "echo": True}, **args)
    for p, e in zip(plain.choices, echoed.choices):
        assert e.message.content == "The capital is" + p.message.content
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens  # the echo is not counted
    chunks = list(client.chat.completions.create(messages=CONTINUED, stream=True,
                                                 extra_body={**CONTINUE, "echo": True}, **args))
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    assert [(c.choices[0].index, c.choices[0].delta.content) for c in chunks[2:4]] == [
        (0, "The capital is"), (1, "The capital is")]
    for i, p in enumerate(plain.choices):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
        assert text == "The capital is" + p.message.content
    # a new turn's role (bot) is not the user's: nothing to echo
    new_turn = client.chat.completions.create(messages=USER, extra_body={"echo": True}, **args)
    assert new_turn.choices[0].message.content == client.chat.completions.create(
        messages=USER, **args).choices[0].message.content


def test_default_max_tokens(server, client, tiny_model):
    """Chat without max_tokens (left out or null): what the context leaves, as vLLM's chat;
    completions keep atom's documented 256."""
    body = dict(model=tiny_model, messages=USER, temperature=0, ignore_eos=True)
    for extra in ({}, {"max_tokens": None}, {"max_completion_tokens": None}):
        r = requests.post(f"{server.url}/v1/chat/completions", json={**body, **extra}, timeout=300)
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN, extra
        assert r.json()["choices"][0]["finish_reason"] == "length"
    out = client.completions.create(model=tiny_model, prompt="Hi", temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 256
