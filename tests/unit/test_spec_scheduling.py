"""The scheduler's side of speculative decoding, with a fake runner: drafts scheduled as
tokens to verify, lookahead KV slots, the roll back of rejected drafts, stops inside an
accepted run, statistics."""

from atom.config import SchedulerConfig
from atom.core_types import PLACEHOLDER, RunnerOutput
from atom.engine.block_manager import BlockManager
from atom.engine.scheduler import Scheduler
from atom.engine.sequence import Sequence
from atom.sampling_params import SamplingParams

BLOCK = 4


def scheduler(k=3, num_blocks=16, budget=64) -> Scheduler:
    return Scheduler(SchedulerConfig(budget, 8), BlockManager(num_blocks, BLOCK), max_model_len=64, num_lookahead=k)


def decoding(s: Scheduler, max_tokens=10, drafts=(11, 12, 13), **params) -> Sequence:
    """A request with a 6-token prompt, prefilled, its first token sampled (7) and drafts."""
    seq = Sequence("r", list(range(100, 106)), SamplingParams(temperature=0, max_tokens=max_tokens, **params))
    s.add(seq)
    batch = s.schedule()
    assert batch.num_new_tokens == [6] and len(seq.block_table) == 3  # 6 tokens + 3 lookahead slots
    s.collect(batch, RunnerOutput({0: 7}, {}, {}, {}, drafts={0: list(drafts)}))
    assert seq.token_ids[6:] == [7] and seq.spec_token_ids == list(drafts)
    return seq


def test_drafts_are_verified_and_the_rejected_roll_back():
    s = scheduler()
    seq = decoding(s)
    batch = s.schedule()
    assert batch.num_new_tokens == [4] and batch.num_drafts == {0: 3} and batch.starts == [6]
    assert seq.token_ids[6:] == [7, 11, 12, 13, PLACEHOLDER] and seq.num_computed_tokens == 10
    assert len(seq.block_table) == 4  # 10 computed + 3 lookahead slots
    # the first draft accepted, the second rejected: the sampled 20 replaces it
    kept = s.collect(batch, RunnerOutput({0: 20}, {}, {}, {}, accepted={0: [11]}, drafts={0: [30, 31, 32]}))
    assert kept == {0: [11, 20]}
    assert seq.token_ids[6:] == [7, 11, 20] and seq.num_computed_tokens == 8
    assert seq.spec_token_ids == [30, 31, 32]
    stats = s.spec_stats.snapshot()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.per_position_rates() == [1.0, 0.0, 0.0] and stats.mean_accepted_length == 2.0


def test_all_accepted_then_a_stop_id_inside_the_next_run():
    s = scheduler()
    seq = decoding(s, stop_token_ids=[31])
    batch = s.schedule()
    assert s.collect(
        batch, RunnerOutput({0: 14}, {}, {}, {}, accepted={0: [11, 12, 13]}, drafts={0: [30, 31, 32]})
    ) == {0: [11, 12, 13, 14]}
    assert seq.num_computed_tokens == 10 and seq.token_ids[6:] == [7, 11, 12, 13, 14]
    batch = s.schedule()
    kept = s.collect(batch, RunnerOutput({0: 33}, {}, {}, {}, accepted={0: [30, 31, 32]}, drafts={0: [1, 2, 3]}))
    assert kept == {0: [30, 31]} and seq.finish_reason == "stop" and seq.token_ids[-2:] == [30, 31]
    assert s.block_manager.num_free_blocks == 16


def test_drafts_are_capped_by_max_tokens_and_budget():
    s = scheduler()
    seq = decoding(s, max_tokens=3)  # one token out, two to go: one draft and the sampled token
    batch = s.schedule()
    assert batch.num_drafts == {0: 1} and seq.token_ids[6:] == [7, 11, PLACEHOLDER]
    kept = s.collect(batch, RunnerOutput({0: 9}, {}, {}, {}, accepted={0: [11]}, drafts={0: [1, 2, 3]}))
    assert kept == {0: [11, 9]} and seq.finish_reason == "length"
    s = scheduler(budget=2)
    seq = Sequence("b", [1, 2], SamplingParams(temperature=0, max_tokens=10))
    s.add(seq)
    s.collect(s.schedule(), RunnerOutput({0: 7}, {}, {}, {}, drafts={0: [11, 12, 13]}))
    assert s.schedule().num_drafts == {0: 1}  # a budget of 2 tokens: the last sampled and one draft
