"""Penalties and logit_bias through the server, sent by the real ``openai`` client: the
server's output equals the in-process engine's with the same SamplingParams (which
``tests/unit/test_logits_processing_engine.py`` shows change the output)."""

from __future__ import annotations

import openai
import pytest
from server_process import MAX_MODEL_LEN

from atom import LLMEngine, SamplingParams

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def reference(tiny_model):
    return LLMEngine(
        tiny_model, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=32 << 20
    )


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=120)


def expected(reference: LLMEngine, **kwargs) -> str:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kwargs)
    return reference.generate([PROMPT], params, use_tqdm=False)[0]["text"]


def complete(client, model, **kwargs) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, temperature=0, max_tokens=24, extra_body={"ignore_eos": True}, **kwargs
    )
    return out.choices[0].text


def test_penalties_match_the_engine(client, tiny_model, reference):
    penalised = complete(client, tiny_model, frequency_penalty=1.5, presence_penalty=0.5)
    assert penalised == expected(reference, frequency_penalty=1.5, presence_penalty=0.5)
    assert penalised != complete(client, tiny_model)


def test_logit_bias_forces_a_token(client, tiny_model, reference):
    token = 42
    text = complete(client, tiny_model, logit_bias={str(token): 100})
    assert text == reference.tokenizer.decode([token] * 24)


def test_chat_penalties_and_logit_bias(client, tiny_model, reference):
    messages = [{"role": "user", "content": "Name a capital city."}]
    out = client.chat.completions.create(
        model=tiny_model,
        messages=messages,
        temperature=0,
        max_tokens=6,
        frequency_penalty=1.0,
        logit_bias={"42": 100},
        extra_body={"ignore_eos": True, "repetition_penalty": 1.2},
    )
    assert out.choices[0].message.content == reference.tokenizer.decode([42] * 6)


@pytest.mark.parametrize(
    ("field", "value"), [("presence_penalty", 3.0), ("logit_bias", {"x": 1.0}), ("logit_bias", {"999999999": 1.0})]
)
def test_bad_values_are_400_naming_the_field(client, tiny_model, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        complete(client, tiny_model, **{field: value})
    assert field in str(err.value)
