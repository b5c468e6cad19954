"""The grammar mask and the penalties together: the same as applying one after the other."""

import torch

from atom.ops.penalties import apply_penalties, pack_bitmask, unpack_bitmask
from atom.worker.logits_processors import apply_logits_processors
from atom.worker.penalty_inputs import RequestPenalties, build_penalty_inputs

VOCAB = 70


def grammar_mask(rows_allowed: list[list[int] | None]) -> torch.Tensor:
    """An xgrammar-layout bitmask with one spare row, as a runner's preallocated one has."""
    allowed = torch.ones(len(rows_allowed) + 1, VOCAB, dtype=torch.bool)
    for row, tokens in enumerate(rows_allowed):
        if tokens is not None:
            allowed[row] = False
            allowed[row, tokens] = True
    return pack_bitmask(allowed)


def test_grammar_mask_and_penalties_combine():
    logits = torch.randn(3, VOCAB)
    requests = [
        RequestPenalties(
            prompt_token_ids=[1, 2],
            output_token_ids=[5, 5],
            frequency_penalty=0.5,
            repetition_penalty=1.3,
            allowed_token_ids=[1, 5, 9, 60],
        ),
        RequestPenalties(prompt_token_ids=[3], output_token_ids=[], logit_bias={4: 2.0}),
        RequestPenalties(prompt_token_ids=[3], output_token_ids=[]),
    ]
    inputs = build_penalty_inputs(requests, VOCAB)
    grammar = grammar_mask([[5, 9, 33], [4, 7], None])
    out = apply_logits_processors(logits, inputs, grammar)
    assert out[0].isfinite().nonzero().flatten().tolist() == [5, 9]  # grammar AND allowed_token_ids
    assert out[1].isfinite().nonzero().flatten().tolist() == [4, 7]
    assert out[2].isfinite().all()
    penalised = apply_penalties(logits, *inputs.args())
    kept = out.isfinite()
    assert torch.equal(out[kept], penalised[kept])
    assert torch.equal(kept, penalised.isfinite() & unpack_bitmask(grammar[:3], VOCAB))


def test_grammar_mask_alone_and_nothing_at_all():
    logits = torch.randn(2, VOCAB)
    assert apply_logits_processors(logits, None, None) is logits
    out = apply_logits_processors(logits, None, grammar_mask([None, [0, 69]]))
    assert torch.equal(out[0], logits[0])
    assert out[1].isfinite().nonzero().flatten().tolist() == [0, 69]
