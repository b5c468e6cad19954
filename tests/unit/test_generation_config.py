"""vLLM's ``--generation-config``: a model's generation_config.json recommends sampling
defaults (Qwen3: temperature 0.6, top_p 0.95, top_k 20) that requests leaving a field out get;
``vllm`` turns them off, a folder path reads them from there."""

from __future__ import annotations

import json
import shutil

import pytest

from atom import LLMEngine, SamplingParams

RECOMMENDED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 7}
ENGINE = dict(dtype="float32", device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory) -> str:
    """The tiny checkpoint with a generation_config.json that recommends sampling defaults."""
    path = tmp_path_factory.mktemp("recommends") / "model"
    shutil.copytree(tiny_model("qwen3"), path)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(gen | RECOMMENDED))
    return str(path)


def test_requests_without_params_get_the_model_defaults(model, caplog):
    with caplog.at_level("INFO"):
        engine = LLMEngine(model, **ENGINE)
    assert "overridden by the model's generation config" in caplog.text
    params = engine.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty, params.max_tokens) == (
        0.6, 0.95, 20, 1.1, 7)
    out = engine.generate([[5, 6, 7, 8]], use_tqdm=False)[0]
    assert len(out["token_ids"]) <= 7
    # explicit params are the caller's own
    explicit = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert len(engine.generate([[5, 6, 7, 8]], explicit, use_tqdm=False)[0]["token_ids"]) == 3


def test_vllm_keeps_vllms_defaults(model):
    engine = LLMEngine(model, generation_config="vllm", **ENGINE)
    assert engine.default_sampling_params == {}
    assert engine.get_default_sampling_params() == SamplingParams()


def test_a_folder_and_a_model_without_recommendations(model, tiny_model, tmp_path):
    plain = LLMEngine(tiny_model("qwen3"), **ENGINE)  # its generation_config.json has only token ids
    assert plain.default_sampling_params == {}
    from_folder = LLMEngine(tiny_model("qwen3"), generation_config=model, **ENGINE)
    assert from_folder.default_sampling_params == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                   "repetition_penalty": 1.1, "max_tokens": 7}
    with pytest.raises(ValueError, match="no generation_config.json"):
        LLMEngine(tiny_model("qwen3"), generation_config=str(tmp_path), **ENGINE)
