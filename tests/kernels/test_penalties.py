"""Penalties and token masks: the batched reference against a per-request loop written from
vLLM's semantics, the Triton kernel against the batched reference, and hand-computed cases."""

import random

import pytest
import torch

from atom.ops.penalties import apply_penalties as reference
from atom.ops.penalties import pack_bitmask, unpack_bitmask
from atom.ops.triton.penalties import apply_penalties as kernel
from atom.testing.tiny_checkpoint import train_tokenizer
from atom.worker.penalty_inputs import RequestPenalties, bad_words_token_ids, build_penalty_inputs

NEG_INF = float("-inf")


def loop_reference(logits: torch.Tensor, requests: list[RequestPenalties]) -> torch.Tensor:
    """One request and one token at a time, in vLLM's sampler order."""
    out = logits.float().clone()
    for row, r in enumerate(requests):
        x = out[row]
        if r.allowed_token_ids is not None:
            for tok in range(x.numel()):
                if tok not in r.allowed_token_ids:
                    x[tok] = NEG_INF
        for word in r.bad_words_token_ids:
            *prefix, last = word
            if (
                len(prefix) <= len(r.output_token_ids)
                and list(r.output_token_ids[len(r.output_token_ids) - len(prefix) :]) == prefix
            ):
                x[last] = NEG_INF
        if len(r.output_token_ids) < r.min_tokens:
            for tok in r.stop_token_ids:
                x[tok] = NEG_INF
        for tok, bias in (r.logit_bias or {}).items():
            x[tok] += bias
        if not r.has_penalty:
            continue
        rep = torch.tensor(r.repetition_penalty, dtype=torch.float32)
        for tok in range(x.numel()):
            count = list(r.output_token_ids).count(tok)
            if tok in r.prompt_token_ids or count:
                x[tok] = x[tok] * (1 / rep if x[tok] > 0 else rep)
            x[tok] -= r.frequency_penalty * count
            if count:
                x[tok] -= r.presence_penalty
    return out


def random_requests(rows: int, vocab: int, rng: random.Random) -> list[RequestPenalties]:
    requests = []
    for row in range(rows):
        # draw from a small range so tokens repeat and prompt and output overlap
        prompt = [rng.randrange(40) for _ in range(rng.randrange(1, 30))]
        output = [rng.randrange(40) for _ in range(rng.randrange(0, 12))]
        neutral = row % 3 == 0
        tail = output[-2:]
        requests.append(
            RequestPenalties(
                prompt_token_ids=prompt,
                output_token_ids=output,
                presence_penalty=0.0 if neutral else rng.uniform(-2, 2),
                frequency_penalty=0.0 if neutral else rng.uniform(-2, 2),
                repetition_penalty=1.0 if neutral else rng.uniform(0.5, 2.0),
                logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randrange(4))},
                min_tokens=rng.randrange(0, 15),
                stop_token_ids=[vocab - 1, rng.randrange(vocab)],
                # one word completed by this step's token (its prefix ends the output), one not
                bad_words_token_ids=[tail + [rng.randrange(vocab)], [7, 3, 5]] if row % 2 else [],
                allowed_token_ids=rng.sample(range(vocab), 50) if row == 4 else None,
            )
        )
    return requests


@pytest.mark.parametrize("rows, vocab", [(6, 300), (5, 2100)])
def test_batched_reference_and_kernel_match_the_loop(rows, vocab):
    rng = random.Random(torch.randint(2**31, ()).item())
    requests = random_requests(rows, vocab, rng)
    logits = 3 * torch.randn(rows, vocab)
    inputs = build_penalty_inputs(requests, vocab)
    batched = reference(logits, *inputs.args())
    torch.testing.assert_close(batched, loop_reference(logits, requests), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(kernel(logits, *inputs.args()), batched, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_reads_half_logits(dtype):
    rng = random.Random(torch.randint(2**31, ()).item())
    requests = random_requests(4, 500, rng)
    logits = (3 * torch.randn(4, 500)).to(dtype)
    inputs = build_penalty_inputs(requests, 500)
    out = kernel(logits, *inputs.args())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference(logits, *inputs.args()), rtol=1e-6, atol=1e-5)


def penalise(requests, logits):
    inputs = build_penalty_inputs(requests, logits.shape[1])
    out = reference(logits, *inputs.args())
    torch.testing.assert_close(kernel(logits, *inputs.args()), out)
    return out


def test_presence_and_frequency_count_output_tokens_repetition_counts_the_prompt_too():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 2.0, 1.0]])
    r = RequestPenalties(
        prompt_token_ids=[0, 1],
        output_token_ids=[2, 2, 3],
        presence_penalty=1.0,
        frequency_penalty=0.5,
        repetition_penalty=2.0,
    )
    out = penalise([r], logits)
    # token 0, 1: prompt only (repetition); 2: twice in the output; 3: once; 4, 5: unseen
    assert out.tolist() == [[1.0, -4.0, 1.0 - 1.0 - 1.0, -4.0 - 0.5 - 1.0, 2.0, 1.0]]


def test_min_tokens_masks_stop_ids_until_reached():
    logits = torch.zeros(2, 8)
    common = dict(prompt_token_ids=[1], min_tokens=3, stop_token_ids=[7, 2])
    below = RequestPenalties(output_token_ids=[4, 5], **common)
    reached = RequestPenalties(output_token_ids=[4, 5, 6], **common)
    out = penalise([below, reached], logits)
    assert out[0].isinf().nonzero().flatten().tolist() == [2, 7]
    assert not out[1].isinf().any()


def test_bad_words_mask_the_last_token_when_the_prefix_ends_the_output():
    words = [[4], [1, 2, 3]]
    cases = {(0, 1, 2): [3, 4], (1, 2, 0): [4], (2,): [4], (): [4]}
    requests = [
        RequestPenalties(prompt_token_ids=[1, 2], output_token_ids=out, bad_words_token_ids=words) for out in cases
    ]
    out = penalise(requests, torch.zeros(len(cases), 6))
    assert [row.isinf().nonzero().flatten().tolist() for row in out] == list(cases.values())


def test_allowed_token_ids_and_logit_bias():
    r = RequestPenalties(
        prompt_token_ids=[0], output_token_ids=[], allowed_token_ids=[1, 33, 40], logit_bias={33: 5.0, 2: 100.0}
    )
    plain = RequestPenalties(prompt_token_ids=[0], output_token_ids=[])
    out = penalise([r, plain], torch.zeros(2, 41))
    assert out[0].isfinite().nonzero().flatten().tolist() == [1, 33, 40]
    assert out[0, 33] == 5.0 and out[0, 2] == NEG_INF
    assert torch.equal(out[1], torch.zeros(41))


def test_nothing_to_do_builds_nothing():
    assert build_penalty_inputs([RequestPenalties(prompt_token_ids=[1], output_token_ids=[2])], 10) is None


def test_bad_words_tokenized_alone_and_after_a_space():
    tok = train_tokenizer()
    ids = bad_words_token_ids(tok, ["the", " quick brown"])
    assert tok.encode("the", add_special_tokens=False) in ids
    assert tok.encode("quick brown", add_special_tokens=False) in ids
    assert all(tok.decode(word).strip() in ("the", "quick brown") for word in ids)
    with pytest.raises(ValueError, match="no tokens"):
        bad_words_token_ids(tok, [" "])


def test_bitmask_round_trip():
    allowed = torch.rand(3, 75) < 0.5
    allowed[0, 31] = allowed[0, 63] = True  # the sign bits of the int32 words
    assert torch.equal(unpack_bitmask(pack_bitmask(allowed), 75), allowed)


def test_kernel_reads_kept_counts():
    from atom.worker.token_counts import TokenCounts

    counts = TokenCounts(max_num_seqs=2, vocab_size=300, device="cpu")
    counts.add_request("a", [1, 2, 3], [7, 7])
    r = RequestPenalties(
        prompt_token_ids=[1, 2, 3],
        output_token_ids=[7, 7],
        presence_penalty=1.0,
        frequency_penalty=0.5,
        repetition_penalty=2.0,
    )
    logits = 3 * torch.randn(2, 300)
    inputs = build_penalty_inputs([r, r], 300, counts=counts.rows(["a", "a"]))  # uint8 prompt rows
    torch.testing.assert_close(kernel(logits, *inputs.args()), loop_reference(logits, [r, r]), rtol=1e-6, atol=1e-5)
