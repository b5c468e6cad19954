"""The rejection sampler keeps the target's distribution (chi-square over a small
vocabulary, fixed seeds) and is exact for greedy rows."""

import torch

from atom.spec_decode.rejection_sampler import rejection_sample, target_probs

VOCAB = 6
TRIALS = 40000
# chi-square with 5 degrees of freedom: P(X > 20.5) = 0.001
CHI2_CRITICAL = 20.52


def _chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=VOCAB).double()
    expected = probs.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def _fixed_dists(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, generator=gen) * 1.5
    q = torch.softmax(torch.randn(VOCAB, generator=gen), -1)
    return logits, q


def _first_tokens(logits, draft_ids, draft_probs, temperature=1.0, **kw) -> torch.Tensor:
    n = draft_ids.shape[0]
    out = rejection_sample(
        logits.expand(n, 1, VOCAB).contiguous(),
        draft_ids[:, None],
        torch.ones(n, dtype=torch.long),
        torch.full((n,), -5, dtype=torch.long),
        torch.full((n,), temperature),
        draft_probs=None if draft_probs is None else draft_probs.expand(n, 1, VOCAB).contiguous(),
        **kw,
    )
    return out[:, 0]


def test_sampled_drafts_keep_the_target_distribution():
    logits, q = _fixed_dists(0)
    torch.manual_seed(1)
    drafts = torch.multinomial(q, TRIALS, replacement=True)
    tokens = _first_tokens(logits, drafts, q)
    p = torch.softmax(logits, -1)
    assert _chi2(tokens, p) < CHI2_CRITICAL
    # the draft distribution differs enough from the target that the test can fail
    assert _chi2(drafts, p) > 10 * CHI2_CRITICAL


def test_greedy_drafts_keep_the_target_distribution_under_top_k_and_temperature():
    logits, q = _fixed_dists(2)
    torch.manual_seed(3)
    drafts = torch.full((TRIALS,), int(q.argmax()))  # an argmax draft: a one-hot draft distribution
    top_k = torch.full((TRIALS,), 4, dtype=torch.int32)
    temperature = torch.tensor(0.7)
    tokens = _first_tokens(logits, drafts, None, temperature=0.7, top_k=top_k)
    p = target_probs(logits[None], temperature[None], top_k[:1], None, None)[0]
    assert (tokens[p[tokens] == 0]).numel() == 0  # never a token top-k excludes
    nonzero = p > 0
    counts = torch.bincount(tokens, minlength=VOCAB)[nonzero].double()
    expected = p[nonzero].double() * TRIALS
    assert float(((counts - expected) ** 2 / expected).sum()) < 16.27  # 3 dof, P = 0.001


def test_second_position_follows_the_target_after_an_accepted_first():
    """With two drafts, the token after an accepted first draft is again the target's."""
    logits, q = _fixed_dists(4)
    torch.manual_seed(5)
    d = torch.multinomial(q, 2 * TRIALS, replacement=True).view(TRIALS, 2)
    out = rejection_sample(
        logits.expand(TRIALS, 2, VOCAB).contiguous(),
        d,
        torch.full((TRIALS,), 2),
        torch.multinomial(torch.softmax(logits, -1), TRIALS, replacement=True),
        torch.ones(TRIALS),
        draft_probs=q.expand(TRIALS, 2, VOCAB).contiguous(),
    )
    second = out[:, 1][out[:, 0] == d[:, 0]]
    assert second.numel() > TRIALS // 10
    assert _chi2(second, torch.softmax(logits, -1)) < CHI2_CRITICAL


def test_seeded_rows_repeat():
    logits, q = _fixed_dists(6)
    drafts = torch.multinomial(q, 8, replacement=True, generator=torch.Generator().manual_seed(0))
    runs = [
        _first_tokens(logits, drafts, q, generators=[torch.Generator().manual_seed(42) for _ in range(8)])
        for _ in range(2)
    ]
    assert torch.equal(*runs)


def test_greedy_rows_accept_the_argmax_prefix():
    logits = torch.randn(3, 3, VOCAB)
    argmax = logits.argmax(-1)
    drafts = argmax.clone()
    drafts[1, 1] = (argmax[1, 1] + 1) % VOCAB
    out = rejection_sample(logits, drafts, torch.tensor([3, 3, 2]), torch.tensor([9, 9, 9]), torch.zeros(3))
    assert out[0].tolist() == [*argmax[0].tolist(), 9]
    assert out[1].tolist() == [int(argmax[1, 0]), int(argmax[1, 1]), -1, -1]
    assert out[2].tolist() == [*argmax[2, :2].tolist(), 9, -1]
