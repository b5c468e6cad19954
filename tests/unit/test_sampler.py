"""Sampler: top-k/top-p/min-p keep exactly the allowed tokens, and seeded sampling is
reproducible and independent of the rest of the batch."""

import pytest
import torch

from atom import LLMEngine, SamplingParams
from atom.worker.sampler import SamplingTensors, sample

PROBS = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.08, 0.04, 0.02, 0.01])


def draw(n=4000, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0):
    logits = PROBS.log().expand(n, -1).contiguous()
    t = SamplingTensors(
        temperatures=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k, dtype=torch.int32) if top_k else None,
        top_p=torch.full((n,), top_p) if top_p < 1 else None,
        min_p=torch.full((n,), min_p) if min_p else None,
        generators=[None] * n,
        all_greedy=temperature == 0,
    )
    torch.manual_seed(seed)
    return torch.bincount(sample(logits, t), minlength=len(PROBS)).float() / n


@pytest.mark.parametrize(
    "kwargs, allowed",
    [
        (dict(top_k=3), [0, 1, 2]),
        (dict(top_p=0.6), [0, 1, 2]),  # 0.30 + 0.25 < 0.6, so the third token is needed
        (dict(top_p=0.55), [0, 1]),  # mass before token 2 is exactly 0.55: excluded
        (dict(min_p=0.3), [0, 1, 2, 3]),  # p >= 0.09
        (dict(top_k=5, top_p=0.8), [0, 1, 2]),  # renormalised over the top-5, mass before token 3 is 0.806
        (dict(temperature=0), [0]),
    ],
)
def test_filters_keep_only_allowed_tokens_with_right_frequencies(kwargs, allowed):
    freq = draw(**kwargs)
    mask = torch.zeros(len(PROBS), dtype=torch.bool)
    mask[allowed] = True
    assert freq[~mask].sum() == 0
    expected = PROBS * mask / (PROBS * mask).sum()
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)


def test_temperature_flattens_distribution():
    hot = draw(temperature=4.0)
    assert hot[7] > 0.05 and hot[0] < 0.25


def test_seeded_sampling_reproducible_and_batch_independent(tiny_model):
    engine = LLMEngine(tiny_model("qwen3"), max_model_len=256)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16)
    alone = engine.generate(["The quick brown fox"], seeded, use_tqdm=False)[0]["token_ids"]
    again = engine.generate(["The quick brown fox"], seeded, use_tqdm=False)[0]["token_ids"]
    mixed = engine.generate(
        ["Once upon a time", "The quick brown fox", "def add(a, b):"],
        [SamplingParams(temperature=0.8, max_tokens=16), seeded, SamplingParams(temperature=1.0, seed=7, max_tokens=9)],
        use_tqdm=False,
    )[1]["token_ids"]
    other_seed = engine.generate(["The quick brown fox"], SamplingParams(temperature=1.0, seed=99, max_tokens=16),
                                 use_tqdm=False)[0]["token_ids"]
    assert alone == again == mixed
    assert other_seed != alone
