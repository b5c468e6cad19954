import pytest
import torch

from atom.ops import reference
from atom.ops.triton import top_k_top_p_min_p
from atom.testing.sampling_checks import rounding_sensitive


def distinct_logits(rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Random logits with distinct values in each row (``test_ties`` has equal ones)."""
    pool = (3 * torch.randn(50 * vocab)).to(dtype).unique()
    assert pool.numel() >= vocab
    return torch.stack([pool[torch.randperm(pool.numel())[:vocab]] for _ in range(rows)])


def check(logits, top_k, top_p, min_p):
    out = top_k_top_p_min_p(logits, top_k, top_p, min_p)
    # The kernel works in float32 whatever the dtype, so compare with the float32 reference
    # (the reference in bf16 would also accumulate probabilities in bf16).
    ref = reference.top_k_top_p_min_p(logits.float(), top_k, top_p, min_p)
    assert out.dtype == logits.dtype
    kept = ~out.isinf()
    differ = kept != ~ref.isinf()
    assert not (differ & ~rounding_sensitive(logits, top_k, top_p, min_p)).any(), f"differ per row {differ.sum(1)}"
    assert torch.equal(out[kept], logits[kept])


def params(rows, vocab):
    top_k = torch.randint(0, 60, (rows,))
    top_k[0], top_k[-1] = 0, vocab  # off, and k = vocab
    top_p = torch.rand(rows) * 0.9 + 0.05
    top_p[1] = 1.0  # off
    min_p = torch.rand(rows) * 0.2
    min_p[2] = 0.0  # off
    return top_k, top_p, min_p


@pytest.mark.parametrize("filters", ["k", "p", "min_p", "k_p", "k_p_min_p"])
def test_top_k_top_p_min_p(filters, dtype):
    rows, vocab = 6, 700
    logits = distinct_logits(rows, vocab, dtype)
    top_k, top_p, min_p = params(rows, vocab)
    check(
        logits,
        top_k if "k" in filters.split("_") else None,
        top_p if "p" in filters.split("_") else None,
        min_p if "min" in filters else None,
    )


def test_extreme_parameters():
    logits = distinct_logits(4, 500, torch.float32)
    logits[3, :100] = float("-inf")  # e.g. a grammar mask: fewer finite tokens than top_k
    check(logits, torch.tensor([1, 500, 499, 450]), torch.tensor([0.0, 1e-6, 0.999, 0.5]), None)


def test_peaked_distribution():
    # One dominant token with a long flat tail: top-p keeps only the head.
    logits = distinct_logits(3, 1000, torch.float32) * 0.01
    logits[:, 7] += 12.0
    check(logits, None, torch.tensor([0.5, 0.99, 0.9999]), None)


def test_ties():
    # Coarse values: equal logits straddle every cut; each group is kept or dropped whole.
    logits = (2 * torch.randn(6, 400)).round() / 2
    top_k, top_p, min_p = params(6, 400)
    top_k[3] = 1  # several tokens may share the maximum
    check(logits, top_k, top_p, min_p)
    check(logits, top_k, None, None)
    check(logits, None, top_p, None)


def test_several_blocks():
    logits = (2 * torch.randn(4, 2500)).round(decimals=2)
    top_k, top_p, min_p = params(4, 2500)
    check(logits, top_k, top_p, min_p)
