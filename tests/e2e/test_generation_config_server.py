"""The server applies the model's recommended sampling defaults (``--generation-config auto``)
to fields a request leaves out, as vLLM does: sent by the real ``openai`` client, a request
without max_tokens / repetition_penalty gets the model's, and equals the in-process engine's
output with those values."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from server_process import MAX_MODEL_LEN, ServerProcess

from atom import LLMEngine, SamplingParams

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]
RECOMMENDED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.3, "max_new_tokens": 9}


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("recommends") / "model"
    shutil.copytree(tiny_model, path)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(gen | RECOMMENDED))
    return str(path)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = ServerProcess(model, tmp_path_factory.mktemp("server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(model):
    engine = LLMEngine(model, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
                       kv_cache_memory_bytes=32 << 20)  # fmt: skip

    def greedy(**params) -> dict:
        return engine.generate([PROMPT], SamplingParams(temperature=0, ignore_eos=True, **params), use_tqdm=False)[0]

    return greedy


def test_left_out_fields_take_the_models_defaults(server, model, reference):
    assert "overridden by the model's generation config" in server.log()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
    out = client.completions.create(model=model, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 9  # the model's max_new_tokens
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 9  # chat's default too: what the context leaves, at most max_new_tokens
    penalised = reference(max_tokens=9, repetition_penalty=1.3)
    assert penalised["token_ids"] != reference(max_tokens=9)["token_ids"]  # the penalty matters here
    assert out.choices[0].text == penalised["text"]
    # a field the request sets is its own
    out = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=4,
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1.0})  # fmt: skip
    assert out.choices[0].text == reference(max_tokens=4)["text"]
