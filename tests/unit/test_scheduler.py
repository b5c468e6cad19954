"""The scheduler alone, with a fake runner (every sampling row samples token 7) and
explicit arrival times for a clock: no model, no device."""

from atom.config import SchedulerConfig
from atom.core_types import PLACEHOLDER, RunnerOutput, SchedulerOutput
from atom.engine.block_manager import BlockManager
from atom.engine.scheduler import Scheduler
from atom.engine.sequence import Sequence, SequenceStatus
from atom.sampling_params import SamplingParams

BLOCK = 4


def scheduler(num_blocks=8, budget=64, max_num_seqs=8, prefix_caching=False) -> Scheduler:
    bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=prefix_caching)
    return Scheduler(SchedulerConfig(budget, max_num_seqs), bm, max_model_len=64)


def request(rid: str, num_tokens: int, max_tokens=4, arrival=0.0, first=None) -> Sequence:
    first = int(rid) * 100 if first is None else first
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Sequence(rid, list(range(first, first + num_tokens)), params, arrival_time=arrival)


def run(s: Scheduler, batch: SchedulerOutput, errors=None) -> dict[int, int]:
    sampled = {i: 7 for i, samples in enumerate(batch.samples) if samples}
    return s.collect(batch, RunnerOutput(sampled, {}, {}, errors or {}))


def rows(batch: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)]


def test_admission_stops_at_block_pressure_and_resumes_when_blocks_free():
    s = scheduler(num_blocks=4)  # 16 tokens
    for i, rid in enumerate("123"):
        s.add(request(rid, 8, max_tokens=1, arrival=float(i)))
    batch = s.schedule()
    assert rows(batch) == [("1", 8), ("2", 8)]  # the third prompt needs blocks that are not free
    assert s.block_manager.num_free_blocks == 0 and [q.request_id for q in s.waiting] == ["3"]
    run(s, batch)  # max_tokens=1: both finish and free their blocks
    assert rows(s.schedule()) == [("3", 8)]


def test_chunked_prefill_shares_the_budget_and_decodes_go_first():
    s = scheduler(budget=6)
    s.add(request("1", 3))
    run(s, s.schedule())  # "1" is decoding now
    s.add(request("2", 10))
    batch = s.schedule()
    assert rows(batch) == [("1", 1), ("2", 5)] and batch.num_decodes == 1
    assert batch.samples == [True, False]  # a partial prompt samples nothing
    run(s, batch)
    batch = s.schedule()
    assert rows(batch) == [("1", 1), ("2", 5)] and batch.samples == [True, True]
    assert batch.starts == [4, 5]


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits():
    # vLLM's --no-enable-chunked-prefill: the second prompt does not fit what the first left of the
    # step's budget, so it waits for the next step instead of being split
    bm = BlockManager(32, BLOCK)
    s = Scheduler(SchedulerConfig(64, 8, enable_chunked_prefill=False), bm, max_model_len=64)
    s.add(request("1", 40, arrival=0.0))
    s.add(request("2", 30, arrival=1.0))
    batch = s.schedule()
    assert rows(batch) == [("1", 40)] and [q.request_id for q in s.waiting] == ["2"]
    run(s, batch)
    assert rows(s.schedule()) == [("1", 1), ("2", 30)]
    chunked = scheduler(num_blocks=32)  # the default splits it
    chunked.add(request("1", 40, arrival=0.0))
    chunked.add(request("2", 30, arrival=1.0))
    assert rows(chunked.schedule()) == [("1", 40), ("2", 24)]


def test_without_chunked_prefill_the_budget_must_hold_a_whole_context(tiny_model):
    import pytest

    from atom.engine.arg_utils import EngineArgs

    args = dict(model=tiny_model("qwen3"), device="cpu", max_model_len=256, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(100\) is smaller than max_model_len \(256\)"):
        EngineArgs(max_num_batched_tokens=100, **args).create_engine_config()
    config = EngineArgs(max_num_batched_tokens=256, **args).create_engine_config()
    assert not config.scheduler_config.enable_chunked_prefill
    # the same greedy tokens as an engine that chunks every prompt
    from atom import LLMEngine, SamplingParams

    prompts = [list(range(10, 60)), list(range(100, 130)), list(range(200, 290))]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    whole = LLMEngine(max_num_batched_tokens=256, kv_cache_memory_bytes=16 << 20, **args)
    chunked = LLMEngine(tiny_model("qwen3"), device="cpu", max_model_len=256, max_num_batched_tokens=32,
                        kv_cache_memory_bytes=16 << 20)  # fmt: skip
    assert [o["token_ids"] for o in whole.generate(prompts, greedy, use_tqdm=False)] == [
        o["token_ids"] for o in chunked.generate(prompts, greedy, use_tqdm=False)]


def test_preemption_frees_the_newest_and_it_resumes_by_recompute():
    s = scheduler(num_blocks=3)  # 12 tokens
    s.add(request("1", 4, max_tokens=6, arrival=0.0))
    s.add(request("2", 4, max_tokens=6, arrival=1.0))
    run(s, s.schedule())  # both prompts: one block each, one token sampled each
    run(s, s.schedule())  # both need a second block: only one is left
    assert s.num_preemptions == 1
    victim = s.waiting[0]
    assert victim.request_id == "2" and victim.status == SequenceStatus.WAITING
    assert victim.num_computed_tokens == 0 and victim.block_table == []
    while s.running:
        run(s, s.schedule())
    batch = s.schedule()  # "2" comes back: its prompt and its sampled token are recomputed
    assert rows(batch) == [("2", 5)] and victim.token_ids[4] == 7


def test_prefix_cache_hit_skips_the_cached_blocks():
    s = scheduler(prefix_caching=True)
    s.add(request("1", 10, max_tokens=1, first=0))
    run(s, s.schedule())
    s.add(request("2", 11, max_tokens=1, first=0))  # shares the first 10 tokens (2 full blocks)
    batch = s.schedule()
    assert batch.starts == [8] and rows(batch) == [("2", 3)]
    assert batch.requests[0].num_cached_tokens == 8


def test_abort_frees_every_block():
    s = scheduler()
    seqs = [request("1", 9), request("2", 30)]  # "2" waits: it needs every block
    for seq in seqs:
        s.add(seq)
    run(s, s.schedule())
    assert s.block_manager.num_free_blocks == 5 and len(s.waiting) == 1
    for seq in seqs:
        s.finish(seq, "abort")
    assert s.block_manager.num_free_blocks == 8 and not s.has_unfinished()


def test_async_placeholder_is_scheduled_before_its_token_arrives():
    s = scheduler()
    s.add(request("1", 4))
    first = s.schedule()
    seq = first.requests[0]
    assert seq.token_ids[-1] == PLACEHOLDER
    second = s.schedule()  # launched before the first step's token is collected
    assert second.starts == [4] and second.requests[0].token_ids[4] == PLACEHOLDER
    assert run(s, first) == {0: [7]} and seq.token_ids[4:] == [7, PLACEHOLDER]
    run(s, second)
    assert seq.token_ids[4:] == [7, 7] and seq.num_computed_tokens == 5


def test_a_failed_row_finishes_alone_and_frees_its_blocks():
    s = scheduler()
    s.add(request("1", 5))
    s.add(request("2", 5))
    batch = s.schedule()
    kept = run(s, batch, errors={0: "ValueError: bad seed"})
    bad, good = batch.requests
    assert kept == {1: [7]}
    assert bad.finish_reason == "error" and bad.error == "ValueError: bad seed" and bad.block_table == []
    assert good.status == SequenceStatus.RUNNING
    while s.has_unfinished():
        run(s, s.schedule())
    assert good.finish_reason == "length" and s.block_manager.num_free_blocks == 8
