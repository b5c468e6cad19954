"""Data-parallel attention (``-dp 2 --enable-dp-attention``, two engine-core processes
whose MoE layers share their experts): greedy output token-identical to one engine in
float32 on the tiny Qwen3-MoE and DeepSeek-V2 (grouped routing, shared experts)
checkpoints, including steps where one replica has nothing to run and sends a padding
token through the MoE layers; each replica loads only its half of the experts; shutdown
leaves no process behind."""

import pytest
from test_data_parallel import PROMPTS
from test_tensor_parallel import wait_gone

from atom import LLMEngine, SamplingParams

# uneven lengths: one replica finishes first and pads the other's remaining steps
PARAMS = [SamplingParams(temperature=0, max_tokens=n) for n in (12, 4, 9, 2)]


def greedy(engine: LLMEngine, prompts=PROMPTS) -> list[list[int]]:
    return [o["token_ids"] for o in engine.generate(prompts, PARAMS[: len(prompts)], use_tqdm=False)]


@pytest.mark.parametrize("arch, kwargs", [("qwen3_moe", {}), ("deepseek_v2", dict(max_num_batched_tokens=16))])
def test_dp_attention_matches_one_engine(tiny_model, arch, kwargs):
    path = tiny_model(arch)
    ref = greedy(LLMEngine(path, max_model_len=256, **kwargs))
    engine = LLMEngine(path, max_model_len=256, data_parallel_size=2, enable_dp_attention=True, **kwargs)
    try:
        pids = engine.core.pids
        assert greedy(engine) == ref
        assert greedy(engine, PROMPTS[:1]) == ref[:1]  # the other replica only pads
        stats = engine.core.stats()
        assert stats.num_free_blocks == stats.num_blocks
    finally:
        engine.shutdown()
    assert wait_gone(pids) == []
