"""The OpenAI server on a tiny block-FP8 DeepSeek-V3 checkpoint (R1's format, MTP layer
included) with an fp8 latent cache, MTP drafts and two tensor-parallel ranks, and through
``atom serve --quantization fp8`` on a float DeepSeek-V3: greedy completions equal
``LLMEngine``'s plain decoding of the same model."""

from __future__ import annotations

import openai
import pytest
from server_process import MAX_MODEL_LEN, ServerProcess

from atom import LLMEngine, SamplingParams

PROMPT = "The quick brown fox"


def engine_text(path: str, **kwargs) -> str:
    engine = LLMEngine(path, max_model_len=MAX_MODEL_LEN, kv_cache_dtype="fp8", **kwargs)
    [out] = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return out["text"]


def complete(server: ServerProcess) -> str:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16
    return out.choices[0].text


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> str:
    from atom.testing.tiny_checkpoint import build

    # row-parallel inputs that split into whole 16-column scale blocks on two ranks
    return build(str(tmp_path_factory.mktemp("v3")), "deepseek_v3", v_head_dim=16, intermediate_size=160,
                 moe_intermediate_size=32)


def test_fp8_deepseek_server_tp2_mtp(deepseek_v3, tmp_path):
    from atom.testing.fp8_checkpoint import write

    path = write(deepseek_v3, str(tmp_path / "fp8"), "block", block=16)
    expected = engine_text(path)
    server = ServerProcess(path, tmp_path, extra_args=("--kv-cache-dtype", "fp8", "--tensor-parallel-size", "2",
                                                       "--method", "mtp", "--num-speculative-tokens", "1"))
    try:
        assert complete(server) == expected
        assert server.metrics()["atom:spec_decode_num_draft_tokens"] > 0
    finally:
        server.stop()


def test_quantization_fp8_deepseek_server(deepseek_v3, tmp_path):
    expected = engine_text(deepseek_v3, quantization="fp8")
    server = ServerProcess(deepseek_v3, tmp_path, via_cli=True,
                           extra_args=("--quantization", "fp8", "--kv-cache-dtype", "fp8", "--method", "mtp",
                                       "--num-speculative-tokens", "1"))
    try:
        assert complete(server) == expected
    finally:
        server.stop()
