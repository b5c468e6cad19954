"""LLMEngine with data_parallel_size=2 (two engine-core processes, each a full replica):
greedy output token-identical to one replica on the tiny Qwen3, Llama (chunked prefill)
and Qwen3-MoE checkpoints (with -tp 2 inside each replica), requests spread over the
replicas, aborts reach the replica that owns the request, stats add up, each replica
writes its own profiler trace, and a killed replica raises a clear error and leaves no
process behind."""

import os
import signal

import psutil
import pytest
from test_tensor_parallel import wait_gone

from atom import LLMEngine, SamplingParams
from atom.config import ParallelConfig
from atom.engine.dp_balancer import LoadBalancer, merge_stats
from atom.engine.outputs import EngineStats
from atom.spec_decode.stats import SpecDecodeStats
from atom.worker.executor import RankFailure

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, a small model learned to count: one, two, three, four, five. " * 3,
    "机器学习 🙂",
    "def add(a, b):",
]
PARAMS = SamplingParams(temperature=0, max_tokens=12)


def greedy(engine: LLMEngine) -> list[list[int]]:
    return [o["token_ids"] for o in engine.generate(PROMPTS, PARAMS, use_tqdm=False)]


def descendants(pids: list[int]) -> list[int]:
    return [c.pid for p in pids for c in psutil.Process(p).children(recursive=True)]


@pytest.mark.parametrize("arch, kwargs", [("qwen3", {}), ("llama", dict(max_num_batched_tokens=32)),
                                          ("qwen3_moe", dict(tensor_parallel_size=2))])
def test_dp2_greedy_matches_one_replica(tiny_model, arch, kwargs):
    path = tiny_model(arch)
    ref = greedy(LLMEngine(path, max_model_len=256))
    engine = LLMEngine(path, max_model_len=256, data_parallel_size=2, **kwargs)
    try:
        pids = engine.core.pids
        ranks = descendants(pids)
        tp = kwargs.get("tensor_parallel_size", 1)
        assert len(ranks) == (2 * tp if tp > 1 else 0)  # each replica's own rank processes
        ids = engine.add_request(PROMPTS, PARAMS)
        assert engine.core.balancer.load == [2, 2]  # least outstanding first: they alternate
        engine.abort_request(ids)
        assert greedy(engine) == ref
        stats = engine.core.stats()
        assert (stats.num_running, stats.num_waiting) == (0, 0)
        assert stats.num_free_blocks == stats.num_blocks == engine.core.info().num_blocks
    finally:
        engine.shutdown()
    assert wait_gone(pids + ranks) == []


def test_abort_reaches_the_owning_replica(tiny_model, tmp_path):
    engine = LLMEngine(tiny_model("qwen3"), max_model_len=256, data_parallel_size=2, torch_profiler_dir=str(tmp_path))
    try:
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        engine.start_profile()  # on both replicas, one trace directory each
        ids = engine.add_request(PROMPTS, long)
        owners = dict(engine.core.balancer.owner)
        assert sorted(owners.values()) == [0, 0, 1, 1]
        while engine.core.stats().num_running < 4:
            engine.step()
        aborted = [ids[0], ids[1]]  # one on each replica
        assert {owners[i] for i in aborted} == {0, 1}
        engine.abort_request(aborted)
        engine.stop_profile()
        assert all(list((tmp_path / f"dp_{r}_rank_0").glob("*.pt.trace.json.gz")) for r in (0, 1))
        # each replica dropped its own: a misrouted abort would leave 4 running (the others
        # have ~190 tokens to go); fewer than 2 only if those finished meanwhile
        assert engine.core.stats().num_running <= 2
        finished = []
        while not engine.is_finished():
            finished += engine.step()
        assert sorted(o.request_id for o in finished) == sorted(ids[2:])
        # each output names the replica that ran it (one request on each here)
        assert sorted(o.engine_index for o in finished) == [0, 1]
        assert all(o.engine_index == owners[o.request_id] for o in finished)
        assert all(len(o.token_ids) == 200 for o in finished)
        stats = engine.core.stats()
        assert stats.num_free_blocks == stats.num_blocks
    finally:
        engine.shutdown()


def test_killed_replica_raises_and_stops_every_replica(tiny_model):
    engine = LLMEngine(tiny_model("qwen3"), max_model_len=256, data_parallel_size=2)
    pids = engine.core.pids
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(RankFailure, match=r"data-parallel replica 1 \(pid \d+\) died with exit code -9"):
        greedy(engine)
    assert wait_gone(pids) == []
    with pytest.raises(RankFailure, match="shut down"):
        greedy(engine)


def test_replica_rank_must_be_in_range():
    with pytest.raises(ValueError, match="data_parallel_rank 2 outside"):
        ParallelConfig(data_parallel_size=2, data_parallel_rank=2)


def test_balancer_least_outstanding_then_kv_usage_and_routes_releases():
    lb = LoadBalancer(3)
    assert [lb.assign(r, [0.0, 0.0, 0.0]) for r in "abc"] == [0, 1, 2]
    assert lb.assign("d", [0.5, 0.1, 0.9]) == 1  # all equally loaded: the emptiest KV cache
    assert lb.finish("a") == 0 and lb.assign("e", [0.0, 0.0, 0.0]) == 0  # least outstanding
    with pytest.raises(ValueError, match="already in use"):
        lb.assign("b", [0.0, 0.0, 0.0])
    assert lb.release(["b", "d", "c", "zz"]) == {1: ["b", "d"], 2: ["c"]}  # unknown ids dropped
    assert (lb.load, lb.num_outstanding) == ([1, 0, 0], 1)


def test_merged_stats_add_up_and_weigh_kv_usage_by_blocks():
    a = EngineStats(1, 2, 0.5, 50, 100, 3, 10, 4)
    b = EngineStats(3, 0, 0.0, 300, 300, 1, 6, 2)
    assert merge_stats([a, b]) == EngineStats(4, 2, 0.125, 350, 400, 4, 16, 6)
    spec = EngineStats(1, 2, 0.5, 50, 100, 3, 10, 4, SpecDecodeStats(2, 4, 3, [2, 2], [2, 1]))
    assert merge_stats([spec]) == spec  # one replica: as it is, speculative-decoding stats kept
    other = EngineStats(0, 0, 0.0, 100, 100, 0, 0, 0, SpecDecodeStats(3, 6, 1, [3, 3], [1, 0]))
    merged = merge_stats([spec, other]).spec  # replicas' counts add up, position by position
    assert merged == SpecDecodeStats(5, 10, 4, [5, 5], [3, 1])
    assert merged.acceptance_rate == 0.4 and merged.mean_accepted_length == 1.8
