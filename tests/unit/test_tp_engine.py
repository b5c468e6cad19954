"""LLMEngine with tensor_parallel_size=2 (two rank processes, gloo on the CPU): greedy
output token-identical to one rank in float32 on the tiny Qwen3, Llama, Qwen3-MoE and
DeepSeek-V2/V3 (latent attention) checkpoints, with expert parallelism too; a killed rank
raises a clear error and leaves no rank behind."""

import os
import signal

import pytest
from test_tensor_parallel import wait_gone

from atom import LLMEngine, SamplingParams
from atom.worker.executor import RankFailure

MAX_TOKENS = 12
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, a small model learned to count: one, two, three, four, five. " * 3,
    "机器学习 🙂",
    "def add(a, b):",
]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
# history-dependent logits processing on every rank (penalties read the request's tokens,
# min_tokens its EOS ids): one prompt carries it
PENALISED = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, frequency_penalty=1.0,
                           repetition_penalty=1.3, logit_bias={7: 2.0})
PARAMS = [GREEDY, PENALISED, GREEDY, GREEDY]


def greedy(engine: LLMEngine) -> list[list[int]]:
    return [o["token_ids"] for o in engine.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def one_rank(tiny_model):
    cache = {}

    def get(arch: str) -> tuple[str, list[list[int]]]:
        if arch not in cache:
            path = tiny_model(arch)
            cache[arch] = path, greedy(LLMEngine(path, max_model_len=256))
        return cache[arch]

    return get


# chunked prefill (a small token budget) and synchronous scheduling on one case each (the
# others schedule asynchronously, the default: placeholder tokens read on each rank from its
# own last sample), to keep the ranks' start-ups few
@pytest.mark.parametrize("arch, kwargs", [
    ("qwen3", dict(async_scheduling=False)),
    ("llama", dict(max_num_batched_tokens=32)),
    ("qwen3_moe", {}),
    ("qwen3_moe", dict(enable_expert_parallel=True)),
    ("deepseek_v3", {}),
    ("deepseek_v2", dict(enable_expert_parallel=True)),
])
def test_tp2_greedy_matches_one_rank(one_rank, arch, kwargs):
    path, ref = one_rank(arch)
    engine = LLMEngine(path, max_model_len=256, tensor_parallel_size=2, **kwargs)
    try:
        assert greedy(engine) == ref
        assert engine.core.block_manager.num_free_blocks == engine.core.block_manager.num_blocks
    finally:
        engine.shutdown()
    assert wait_gone(engine.core.runner.executor.pids) == []


def test_killed_rank_raises_and_stops_every_rank(tiny_model):
    engine = LLMEngine(tiny_model("qwen3"), max_model_len=256, tensor_parallel_size=2)
    pids = engine.core.runner.executor.pids
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) died with exit code -9"):
        greedy(engine)
    assert wait_gone(pids) == []
    with pytest.raises(RankFailure, match="shut down"):
        greedy(engine)


def test_bad_split_is_refused_before_any_rank_starts(tiny_model):
    with pytest.raises(ValueError, match="num_attention_heads .* divisible by tensor_parallel_size"):
        LLMEngine(tiny_model("qwen3"), max_model_len=256, tensor_parallel_size=4)


def logprobs_run(engine: LLMEngine) -> list:
    """(prompt logprobs, sampled tokens' logprobs) of each prompt: the ranks read a window
    of each request's tokens, and a prompt logprob's target lies one past it."""
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=2)
    ids = engine.add_request([engine.tokenizer.encode(p) for p in PROMPTS], params)
    done = {}
    while len(done) < len(ids):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [(done[i].prompt_logprobs, done[i].logprobs) for i in ids]


def test_tp2_prompt_and_sample_logprobs_match_one_rank(tiny_model):
    path = tiny_model("qwen3")
    ref = logprobs_run(LLMEngine(path, max_model_len=256, max_num_batched_tokens=16))  # chunked prompts
    engine = LLMEngine(path, max_model_len=256, max_num_batched_tokens=16, tensor_parallel_size=2)
    try:
        got = logprobs_run(engine)
    finally:
        engine.shutdown()
    for (ref_prompt, ref_out), (prompt, out) in zip(ref, got):
        assert len(prompt) == len(ref_prompt) > 1 and len(out) == len(ref_out) == 4
        for a, b in zip(ref_prompt[1:] + ref_out, prompt[1:] + out):
            assert (a.token_id, [t for t, _ in a.top]) == (b.token_id, [t for t, _ in b.top])
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
            assert abs(b.rank - a.rank) <= 1  # a rank deep in the tail can swap with a float32 near-tie


def test_tp2_structured_output_and_seeded_sampling_match_one_rank(tiny_model):
    """The grammar bitmask travels to the ranks with the step (pickled by value)."""
    from atom.sampling_params import StructuredOutputsParams

    choice, regex = StructuredOutputsParams(choice=["yes", "no"]), StructuredOutputsParams(regex="[a-z]{3,6}")
    params = [
        SamplingParams(temperature=0, max_tokens=12, structured_outputs=choice),
        SamplingParams(temperature=0.8, seed=5, max_tokens=12),
        SamplingParams(temperature=0.8, seed=7, max_tokens=12, structured_outputs=regex),
    ]
    prompts = ["Answer:", "Hello there", "Word:"]
    path = tiny_model("qwen3")
    ref = [o["token_ids"] for o in LLMEngine(path, max_model_len=256).generate(prompts, params, use_tqdm=False)]
    engine = LLMEngine(path, max_model_len=256, tensor_parallel_size=2)
    try:
        got = engine.generate(prompts, params, use_tqdm=False)
    finally:
        engine.shutdown()
    assert [o["token_ids"] for o in got] == ref
    assert got[0]["text"] in ("yes", "no")
