"""Validation before anything reaches the engine: ``SamplingParams`` ranges and the shared
``InputProcessor`` (tokenising, vocabulary and length checks, chat template)."""

from __future__ import annotations

import math
import time

import pytest
from transformers import AutoTokenizer

from atom import LLMEngine, SamplingParams
from atom.engine.input_processor import InputProcessor, InvalidInputError


@pytest.mark.parametrize(
    "field, value",
    [
        ("seed", 2**64),
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("top_k", 2**31),
        ("top_k", 10**400),
        ("max_tokens", 2**63),
        ("max_tokens", True),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", math.nan),
        ("min_p", math.nan),
        ("logprobs", -1),
        ("prompt_logprobs", 2**63),
        ("stop", ["\ud800"]),
        ("stop_token_ids", [2**64]),
    ],
)
def test_sampling_params_refuse_what_the_engine_cannot_run(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**{field: value})


def test_sampling_params_edges_are_accepted():
    # logprobs has no cap here: the engine's max_logprobs (--max-logprobs) is checked when a request is added
    SamplingParams(seed=2**63 - 1, top_k=2**31 - 1, logprobs=10**6, prompt_logprobs=0)
    SamplingParams(seed=-(2**63), top_k=-1)
    assert SamplingParams(temperature=1e-6).temperature == 0.01  # clamped, as vLLM does
    assert SamplingParams(temperature=0).temperature == 0


@pytest.fixture(scope="module")
def processor(tiny_model) -> InputProcessor:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model("qwen3"))
    return InputProcessor(tokenizer, vocab_size=len(tokenizer), max_model_len=64)


@pytest.mark.parametrize("max_logprobs", [20, 3, -1])
def test_logprobs_are_checked_against_max_logprobs(processor, max_logprobs):
    """vLLM's --max-logprobs (default 20; -1: the vocabulary), for logprobs and prompt logprobs."""
    limited = InputProcessor(processor.tokenizer, processor.vocab_size, 64, max_logprobs=max_logprobs)
    limit = processor.vocab_size if max_logprobs == -1 else max_logprobs
    for field in ("logprobs", "prompt_logprobs"):
        limited.process_params(SamplingParams(**{field: limit}))
        with pytest.raises(InvalidInputError, match=f"greater than max allowed: {limit}") as info:
            limited.process_params(SamplingParams(**{field: limit + 1}))
        assert info.value.param == field


def test_tokenize_matches_the_tokenizer(processor):
    text = "The quick brown fox jumps over the lazy dog."
    out = processor.tokenize(text)
    assert out.text == text and out.token_ids == processor.tokenizer.encode(text)
    assert processor.tokenize([1, 2, 3]).token_ids == [1, 2, 3]


@pytest.mark.parametrize(
    "prompt, match",
    [
        ("", "empty"),
        ([], "empty"),
        ("a\ud800b", "lone surrogate"),
        ([1, -1], "token ids"),
        ([1, 10**9], "token ids"),
        ([1, True], "token ids"),
        ([5] * 65, "65 tokens exceeds the limit of 64"),
    ],
)
def test_bad_prompts_name_the_field(processor, prompt, match):
    with pytest.raises(InvalidInputError, match=match) as info:
        processor.tokenize(prompt, param="prompt")
    assert info.value.param == "prompt"


def test_too_long_text_is_refused(processor):
    words = "The quick brown fox jumps over the lazy dog. " * 8
    with pytest.raises(InvalidInputError, match="more than 64 tokens") as info:
        processor.tokenize(words)
    assert info.value.code == "context_length_exceeded"
    exact = processor.tokenizer.encode(words)[:64]
    assert processor.tokenize(exact).token_ids == exact  # exactly the limit fits
    # far too long to fit: refused from its length alone, without tokenising 50 MB
    start = time.perf_counter()
    with pytest.raises(InvalidInputError, match="more than 64 tokens"):
        processor.tokenize(words * 150_000)
    assert time.perf_counter() - start < 1.0


def test_chat_template(processor):
    out = processor.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert out.text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert out.token_ids == processor.tokenizer.encode(out.text, add_special_tokens=False)
    with pytest.raises(InvalidInputError, match="non-empty") as info:
        processor.apply_chat_template([])
    assert info.value.param == "messages"
    with pytest.raises(InvalidInputError, match="lone surrogate") as info:
        processor.apply_chat_template([{"role": "user", "content": "\udfff"}])
    assert info.value.param == "messages"


def test_llm_engine_refuses_before_the_engine_runs(tiny_model):
    engine = LLMEngine(tiny_model("qwen3"), max_model_len=64, kv_cache_memory_bytes=8 << 20)
    with pytest.raises(ValueError, match="token ids must be ints"):
        engine.add_request([[1, 10**9]])
    with pytest.raises(ValueError, match="lone surrogate"):
        engine.add_request(["Hello \ud800"])
    with pytest.raises(ValueError, match="SamplingParams.seed"):
        engine.add_request(["Hello"], SamplingParams(seed=2**64))
    out = engine.generate(
        ["Hello"], SamplingParams(temperature=1.0, seed=2**63 - 1, top_k=2**31 - 1, max_tokens=3), use_tqdm=False
    )
    assert out[0]["num_tokens_output"] == 3
