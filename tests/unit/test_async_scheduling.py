"""Async scheduling (step N+1 scheduled and launched before step N's tokens are read) gives
exactly the outputs of the synchronous engine, for every way a request can end."""

import pytest

from atom import LLMEngine, SamplingParams

SHARED = "Prefix caching reuses the KV cache of a shared system prompt across requests. " * 2
PROMPTS = ["The quick brown fox", "Once upon a time, a small model", SHARED + "def add(a, b):", "机器学习 模型",
           SHARED + "Paged attention stores keys", SHARED + "Prefix caching reuses the KV cache"]


def run(engine: LLMEngine, prompts, params) -> dict[str, tuple]:
    """Every request's final output, with its logprobs, by prompt index."""
    ids = engine.add_request(prompts, params)
    done = {}
    while not engine.is_finished():
        for out in engine.step():
            done[out.request_id] = out
    results = {}
    for i, rid in enumerate(ids):
        o = done[rid]
        lps = [(lp.token_id, lp.rank, lp.logprob) for lp in o.logprobs or []]
        plps = [lp and (lp.token_id, lp.logprob) for lp in o.prompt_logprobs or []]
        results[i] = (o.token_ids, o.text, o.finish_reason, o.stop_reason, lps, plps)
    return results


def assert_same(got: dict, expected: dict) -> None:
    """Identical tokens, text and finish; logprobs equal up to float32 batch-shape noise
    (the two engines run the rows in differently composed batches)."""
    assert got.keys() == expected.keys()
    for i in expected:
        assert got[i][:4] == expected[i][:4], i
        for a, b in zip(got[i][4:], expected[i][4:]):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert (x is None) == (y is None), i
                assert x is None or (x[:-1] == y[:-1] and x[-1] == pytest.approx(y[-1], abs=1e-4)), i


@pytest.fixture(scope="module")
def engines(tiny_model):
    path = tiny_model("qwen3")
    kwargs = dict(max_model_len=256, enable_prefix_caching=True)
    return LLMEngine(path, async_scheduling=False, **kwargs), LLMEngine(path, async_scheduling=True, **kwargs)


def workload(engine: LLMEngine) -> list[SamplingParams]:
    """Requests ending by length, EOS-like stop token, stop string, abort-free sampling with
    seeds, logprobs and prompt logprobs, all in one batch."""
    greedy = engine.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    stop_token = greedy[0]["token_ids"][4]  # hit at (or before) the 5th token
    stop_text = greedy[1]["text"][6:9]
    return [
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=12, stop=[stop_text]),
        SamplingParams(temperature=1.0, seed=11, max_tokens=17, logprobs=3),
        SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2),
        SamplingParams(temperature=0.8, seed=5, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    ]


def test_async_outputs_equal_sync(engines):
    sync, async_ = engines
    params = workload(sync)
    expected = run(sync, PROMPTS, params)
    assert expected[0][2] == "stop" and expected[1][2] == "stop" and expected[5][2] == "length"
    assert_same(run(async_, PROMPTS, params), expected)
    assert_same(run(async_, PROMPTS, params), expected)  # again: now with prefix-cache hits
    bm = async_.core.block_manager
    assert bm.num_prefix_hits > 0
    assert bm.num_free_blocks == bm.num_blocks and not async_.core.requests


def test_async_steps_lag_one_step(engines):
    """The overlap is real: an async step returns the tokens of the step launched before it,
    and a sequence at its last token is not scheduled again while that token is in flight."""
    for engine, expected in zip(engines, ([1, 1, 1], [0, 1, 1, 1])):
        streamed: list[int] = []
        engine.add_request(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                           stream_callback=lambda out, streamed=streamed: streamed.extend(out.new_token_ids))
        per_step = []
        while not engine.is_finished():
            before = len(streamed)
            engine.step()
            per_step.append(len(streamed) - before)
        assert per_step == expected


def test_async_abort_mid_flight_frees_blocks(engines):
    _, async_ = engines
    ids = async_.add_request(PROMPTS, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        async_.step()
    async_.abort_request(ids[::2])
    finished = []
    while not async_.is_finished():
        finished += async_.step()
    assert sorted(o.request_id for o in finished) == sorted(ids[1::2])
    assert all(len(o.token_ids) == 50 for o in finished)
    bm = async_.core.block_manager
    assert bm.num_free_blocks == bm.num_blocks
