"""What the engine sends its tensor-parallel ranks each step: a window of each request's
tokens, indexed as the whole list, or the whole list where logits processing reads it."""

import pytest

from atom.core_types import SchedulerOutput
from atom.engine.sequence import Sequence
from atom.sampling_params import SamplingParams
from atom.worker.rank_worker import TokenWindow, snapshot


def test_token_window_reads_as_the_whole_list_inside_and_refuses_outside():
    tokens = list(range(100, 120))
    w = TokenWindow.cut(tokens, 5, 9)
    assert len(w) == len(tokens)
    assert [w[i] for i in range(5, 9)] == tokens[5:9]
    assert w[5:9] == tokens[5:9] and w[6:8] == tokens[6:8] and w[7:7] == []
    assert w[-12] == tokens[-12]  # index 8
    for bad in (4, 9, -1):
        with pytest.raises(IndexError, match="outside the window"):
            w[bad]
    for bad in (slice(4, 6), slice(8, 10), slice(5, 9, 2)):
        with pytest.raises(IndexError, match="outside the window"):
            w[bad]
    assert TokenWindow.cut(tokens, 18, 25)[18:20] == tokens[18:20]  # a window cut at the end


def test_snapshot_sends_the_step_window_or_the_whole_history():
    plain = Sequence("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=4))
    penalised = Sequence("b", [7, 8, 9], SamplingParams(max_tokens=4, repetition_penalty=1.2))
    for seq in (plain, penalised):
        seq.block_table = [3, 4]
    batch = SchedulerOutput(requests=[plain, penalised], num_new_tokens=[2, 3], starts=[4, 0], samples=[True, True])
    sent = snapshot(batch).requests
    assert isinstance(sent[0].token_ids, TokenWindow) and sent[0].token_ids[4:6] == [5, 6]
    assert sent[1].token_ids == [7, 8, 9] and sent[1].token_ids is not penalised.token_ids
    assert sent[0].block_table == [3, 4] and sent[0].request_id == plain.request_id


def test_snapshot_leaves_known_requests_sampling_params_behind():
    seqs = [Sequence("a", [1, 2, 3], SamplingParams(max_tokens=4)), Sequence("b", [4, 5], SamplingParams(seed=3))]
    batch = SchedulerOutput(requests=seqs, num_new_tokens=[3, 2], starts=[0, 0], samples=[True, True])
    first, second = snapshot(batch, {"a"}).requests
    assert first.sampling_params is None and first.eos_token_ids is None
    assert second.sampling_params is seqs[1].sampling_params
