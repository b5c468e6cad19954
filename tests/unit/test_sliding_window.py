"""Models with sliding-window layers (Mistral; Qwen2 with ``use_sliding_window``): atom's full
attention is the same up to the window's length, so atom serves them up to it and no further."""

import logging

import pytest
from transformers import MistralConfig, Qwen2Config

from atom import LLMEngine, SamplingParams
from atom.config import sliding_window
from atom.testing.tiny_checkpoint import build


def test_which_configs_have_a_window():
    assert sliding_window(MistralConfig(sliding_window=4096)) == 4096
    assert sliding_window(MistralConfig(sliding_window=None)) is None
    # Qwen2.5's configs carry a window they do not use
    assert sliding_window(Qwen2Config(sliding_window=131072, use_sliding_window=False)) is None
    assert sliding_window(Qwen2Config(sliding_window=4096, use_sliding_window=True, max_window_layers=1,
                                      num_hidden_layers=2)) == 4096  # fmt: skip


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A tiny Mistral whose 64-token window is shorter than its 2048 positions."""
    return build(str(tmp_path_factory.mktemp("tiny-mistral-window")), "mistral", sliding_window=64)


def test_default_length_is_the_window(windowed, caplog):
    with caplog.at_level(logging.WARNING, logger="atom.engine.arg_utils"):
        engine = LLMEngine(windowed)
    assert engine.config.model_config.max_model_len == 64
    assert "sliding-window attention (window 64)" in caplog.text
    out = engine.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 8


def test_longer_than_the_window_is_refused(windowed):
    why = r"longer than the model's sliding attention window \(64\).*--max-model-len 64"
    with pytest.raises(ValueError, match=why):
        LLMEngine(windowed, max_model_len=65)


def test_same_as_transformers_up_to_the_window(windowed):
    """transformers applies the 64-token window; atom attends to everything: the same tokens
    for sequences of up to 64 tokens (prompt + output)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(windowed)
    ids = tok("Once upon a time, a small model learned to count: one, two, three, four. " * 3).input_ids[:40]
    model = AutoModelForCausalLM.from_pretrained(windowed, dtype=torch.float32)
    ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=64 - len(ids), do_sample=False)[0, len(ids):].tolist()  # fmt: skip
    engine = LLMEngine(windowed)
    out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=64 - len(ids)), use_tqdm=False)
    assert len(ids) == 40 and out[0]["token_ids"] == ref
