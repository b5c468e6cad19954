"""The rejection step of speculative decoding: Triton kernel (interpreted) vs reference."""

import pytest
import torch

from atom.ops import rejection
from atom.ops.triton.rejection import rejection_sample as triton_rejection_sample


def _inputs(batch: int, k: int, vocab: int = 6):
    """Small vocabulary and probabilities near one another, so that every branch (accept,
    reject, all accepted, no drafts) occurs."""
    draft = torch.randint(vocab, (batch, k))
    argmax = torch.where(torch.rand(batch, k) < 0.6, draft, torch.randint(vocab, (batch, k)))
    target_p, draft_p = torch.rand(batch, k), torch.rand(batch, k)
    draft_p[0, 0] = 0.0  # a draft its own distribution gives no mass: always rejected
    return (
        draft,
        torch.randint(0, k + 1, (batch,)),
        argmax,
        target_p,
        draft_p,
        torch.rand(batch, k),
        torch.randint(vocab, (batch, k)),
        torch.randint(vocab, (batch,)),
        torch.randint(0, 2, (batch,), dtype=torch.int32),
    )


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_kernel_matches_reference(k):
    args = _inputs(64, k)
    ref = rejection.rejection_sample(*args)
    out = triton_rejection_sample(*args)
    assert torch.equal(out, ref)
    # each row: accepted drafts, one sampled token, then padding
    for row, n in zip(ref.tolist(), args[1].tolist()):
        filled = [t for t in row if t != -1]
        assert 1 <= len(filled) <= n + 1 and row[len(filled) :] == [-1] * (k + 1 - len(filled))


def test_reference_semantics_by_hand():
    draft = torch.tensor([[3, 4, 5], [3, 4, 5], [3, 4, 5]])
    argmax = torch.tensor([[3, 4, 5], [3, 9, 5], [0, 0, 0]])
    ones = torch.ones(3, 3)
    # greedy rows: all accepted + bonus; rejected at the second draft; only one draft to verify
    out = rejection.rejection_sample(
        draft,
        torch.tensor([3, 3, 0]),
        argmax,
        ones,
        ones,
        ones,
        argmax,
        torch.tensor([7, 7, 7]),
        torch.ones(3, dtype=torch.int32),
    )
    assert out.tolist() == [[3, 4, 5, 7], [3, 9, -1, -1], [7, -1, -1, -1]]
    # a sampling row: uniform * p_draft < p_target accepts, else the recovered token
    target_p = torch.tensor([[0.5, 0.2, 0.9]])
    out = rejection.rejection_sample(
        draft[:1],
        torch.tensor([3]),
        argmax[:1],
        target_p,
        torch.ones(1, 3),
        torch.tensor([[0.4, 0.3, 0.0]]),
        torch.tensor([[1, 2, 1]]),
        torch.tensor([7]),
        torch.zeros(1, dtype=torch.int32),
    )
    assert out.tolist() == [[3, 2, -1, -1]]
