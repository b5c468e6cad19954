"""Penalties, logit_bias and the token masks through ``LLMEngine`` (the runner applies them
before sampling), with async scheduling on, as the server runs."""

from __future__ import annotations

import pytest

from atom import LLMEngine, SamplingParams
from atom.worker.penalty_inputs import bad_words_token_ids

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(tiny_model("qwen3"), max_model_len=256, num_gpu_blocks_override=64, async_scheduling=True)


def generate(engine, **kwargs) -> list[int]:
    kwargs.setdefault("max_tokens", 32)
    params = SamplingParams(temperature=0, **kwargs)
    return engine.generate([PROMPT], params, use_tqdm=False)[0]["token_ids"]


def repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


@pytest.mark.parametrize(
    "penalty", [{"frequency_penalty": 1.5}, {"presence_penalty": 1.5}, {"repetition_penalty": 2.0}]
)
def test_penalties_reduce_repetition(engine, penalty):
    plain = generate(engine, ignore_eos=True)
    assert repeats(plain) >= 4  # greedy decoding of the tiny random model comes back to some tokens
    assert repeats(generate(engine, ignore_eos=True, **penalty)) < repeats(plain)


def test_min_tokens_prevents_an_early_eos(engine):
    first = generate(engine, ignore_eos=True, max_tokens=1)[0]
    # make the greedy first token a stop id: without min_tokens the request ends at once
    assert generate(engine, stop_token_ids=[first]) == [first]
    out = generate(engine, stop_token_ids=[first], min_tokens=6, max_tokens=20)
    assert len(out) >= 6 and first not in out[:6]


def test_logit_bias_forces_a_token(engine):
    assert generate(engine, max_tokens=8, ignore_eos=True, logit_bias={"42": 100}) == [42] * 8


def test_allowed_token_ids_restrict_the_output(engine):
    allowed = [11, 12, 13]
    out = generate(engine, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed)
    assert len(out) == 16 and set(out) <= set(allowed)


def test_bad_words_are_avoided(engine):
    plain = generate(engine, ignore_eos=True)
    # a word of the plain output that is one token (alone or after a space)
    words = {engine.tokenizer.decode([t]).strip(): t for t in plain}
    word, banned = next(
        (w, {i[0] for i in bad_words_token_ids(engine.tokenizer, [w]) if len(i) == 1})
        for w in words
        if w and any(len(i) == 1 and i[0] in plain for i in bad_words_token_ids(engine.tokenizer, [w]))
    )
    out = generate(engine, ignore_eos=True, bad_words=[word])
    assert banned & set(plain) and not banned & set(out) and len(out) == len(plain)


def test_penalties_match_the_synchronous_engine(engine, tiny_model):
    sync = LLMEngine(tiny_model("qwen3"), max_model_len=256, num_gpu_blocks_override=64, async_scheduling=False)
    kwargs = dict(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.3, ignore_eos=True)
    assert generate(engine, **kwargs) == generate(sync, **kwargs)


def test_bad_values_name_the_field(engine):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        engine.add_request([PROMPT], SamplingParams(allowed_token_ids=[10**9]))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request([PROMPT], SamplingParams(logit_bias={10**9: 1.0}))
    with pytest.raises(ValueError, match="SamplingParams.presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    assert engine.is_finished()
