"""Token counts kept between steps equal counting the token lists afresh."""

import random

import pytest
import torch

from atom.ops.penalties import apply_penalties, token_counts
from atom.worker.penalty_inputs import RequestPenalties, build_penalty_inputs
from atom.worker.token_counts import TokenCounts

VOCAB = 50


def fresh(lists):
    width = max(1, max(len(t) for t in lists))
    return token_counts(torch.tensor([t + [VOCAB] * (width - len(t)) for t in lists]), VOCAB)


def test_counts_follow_the_steps():
    rng = random.Random(torch.randint(2**31, ()).item())
    counts = TokenCounts(max_num_seqs=3, vocab_size=VOCAB, device="cpu")
    prompts = {rid: [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))] for rid in "abc"}
    outputs = {"a": [], "b": [3, 3, 7], "c": []}
    for rid in "ab":
        counts.add_request(rid, prompts[rid], outputs[rid])
    for step in range(12):
        if step == 4:  # c joins, a leaves, its row is reused
            counts.remove_request("a")
            counts.add_request("c", prompts["c"])
        batch = ["b", "untracked", "c" if step >= 4 else "a"]
        sampled = torch.randint(VOCAB, (3,))
        for rid, token in zip(batch, sampled.tolist()):
            if rid in outputs:
                outputs[rid].append(token)
        counts.record(batch, sampled)
        live = [rid for rid in batch if rid in counts]
        prompt_rows, output_rows = counts.rows(live)
        assert torch.equal(prompt_rows > 0, fresh([prompts[r] for r in live]) > 0)
        assert torch.equal(output_rows, fresh([outputs[r] for r in live]))
    prompt_rows, output_rows = counts.rows(["untracked"])
    assert not prompt_rows.any() and not output_rows.any()


def test_penalties_from_kept_counts_equal_penalties_from_lists():
    counts = TokenCounts(max_num_seqs=2, vocab_size=VOCAB, device="cpu")
    requests = [
        RequestPenalties(
            prompt_token_ids=[1, 2, 2],
            output_token_ids=[4, 4, 9],
            presence_penalty=0.5,
            frequency_penalty=0.25,
            repetition_penalty=1.5,
        ),
        RequestPenalties(prompt_token_ids=[5], output_token_ids=[6]),
    ]
    counts.add_request("x", requests[0].prompt_token_ids, requests[0].output_token_ids)
    logits = torch.randn(2, VOCAB)
    from_lists = build_penalty_inputs(requests, VOCAB)
    kept = build_penalty_inputs(requests, VOCAB, counts=counts.rows(["x", "y"]))
    assert torch.equal(apply_penalties(logits, *kept.args()), apply_penalties(logits, *from_lists.args()))


def test_a_full_table_is_a_clear_error():
    counts = TokenCounts(max_num_seqs=1, vocab_size=VOCAB, device="cpu")
    counts.add_request("a", [1])
    with pytest.raises(RuntimeError, match="holds 1 requests"):
        counts.add_request("b", [1])
