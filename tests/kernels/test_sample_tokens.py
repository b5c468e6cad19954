"""The fused sampling kernel against its reference (``atom.ops.sampling``): both draw the
same Philox noise, so they must pick the same token, up to float rounding at a cut or a
near-tie of the race."""

import pytest
import torch
import triton
import triton.language as tl

from atom.ops import reference, sampling
from atom.ops.triton import sample_tokens, sampling_fused
from atom.testing.sampling_checks import check_tokens


def mixed_params(rows, vocab):
    temps = torch.rand(rows) * 1.5 + 0.2
    temps[0] = 0.0  # greedy
    top_k = torch.randint(0, 40, (rows,), dtype=torch.int32)
    top_k[1], top_k[2], top_k[3] = 1, vocab, 0
    top_p = torch.rand(rows) * 0.9 + 0.05
    top_p[3], top_p[4], top_p[5] = 1.0, 0.999, 1 - 1e-6  # off, and near 1
    min_p = torch.rand(rows) * 0.2
    min_p[6] = 0.0
    return temps, top_k, top_p, min_p


@pytest.mark.parametrize("filters", ["none", "k", "p", "min_p", "k_p_min_p"])
def test_matches_reference_mixed_rows(filters, dtype):
    rows, vocab = 10, 300
    logits = (3 * torch.randn(rows, vocab)).to(dtype)
    temps, top_k, top_p, min_p = mixed_params(rows, vocab)
    names = filters.split("_")
    check_tokens(
        sample_tokens,
        logits,
        temps,
        top_k if "k" in names else None,
        top_p if "p" in names else None,
        min_p if "min" in names else None,
        torch.randint(1 << 62, (rows,)),
    )


@pytest.fixture(params=[4096, 40], ids=["buffer", "small_buffer"])
def capacity(request, monkeypatch):
    """The candidate buffer's size: rows whose bound leaves more tokens search the whole row."""
    monkeypatch.setattr(sampling_fused, "_CAPACITY", request.param)


def test_ties_and_masked_tokens(capacity):
    # Coarse values: many equal logits at every cut; a grammar-like mask leaves few finite.
    rows, vocab = 8, 257
    logits = (2 * torch.randn(rows, vocab)).round() / 2
    logits[7, 10:] = float("-inf")
    temps, top_k, top_p, min_p = mixed_params(rows, vocab)
    temps[5] = 1.0  # u == x: ties exactly as given
    check_tokens(sample_tokens, logits, temps, top_k, top_p, min_p, torch.randint(1 << 62, (rows,)))


def test_same_seed_same_token_any_batch():
    logits = 2 * torch.randn(4, 200)
    temps, top_k, top_p = torch.ones(4), torch.full((4,), 30, dtype=torch.int32), torch.full((4,), 0.9)
    seeds = torch.randint(1 << 62, (4,))
    full = sample_tokens(logits, temps, top_k, top_p, None, seeds)
    alone = sample_tokens(logits[2:3], temps[2:3], top_k[2:3], top_p[2:3], None, seeds[2:3])
    assert full[2] == alone[0]


def test_reference_noise_is_exponential_race():
    """Statistics of the reference (which the kernel matches token for token): frequencies
    over 40000 seeds equal the filtered distribution within 6 standard deviations."""
    torch.manual_seed(0)
    n, probs = 40000, torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])
    logits = probs.log().expand(n, -1)
    top_k = torch.full((n,), 4, dtype=torch.int32)
    tokens = sampling.sample_tokens(logits, torch.ones(n), top_k, None, None, torch.randint(1 << 62, (n,)))
    freq = torch.bincount(tokens, minlength=6).double() / n
    expect = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.0, 0.0]).double() / 0.9
    assert ((freq - expect).abs() <= 6 * (expect * (1 - expect) / n).sqrt()).all(), (freq, expect)


def test_philox_matches_triton():
    @triton.jit
    def bits_kernel(seed_ptr, out_ptr, N: tl.constexpr):
        seed = tl.load(seed_ptr + tl.program_id(0))
        r0, r1, r2, r3 = tl.randint4x(seed, tl.arange(0, N // 4))
        bits = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [N])
        tl.store(out_ptr + tl.program_id(0) * N + tl.arange(0, N), bits.to(tl.uint32, bitcast=True).to(tl.int64))

    seeds = torch.cat([torch.tensor([0, (1 << 62) - 1]), torch.randint(1 << 62, (3,))])
    out = torch.empty(5, 64, dtype=torch.int64)
    bits_kernel[(5,)](seeds, out, 64)
    assert torch.equal(out, sampling.philox_bits(seeds, 64))


def test_several_blocks(capacity):
    # Rows longer than one block (1024): blocks without a token in the search bracket, or
    # without a kept token, take the shortcut.
    rows, vocab = 8, 2500
    logits = 3 * torch.randn(rows, vocab)
    logits[1] = (logits[1] * 2).round() / 2  # ties
    temps, top_k, top_p, min_p = mixed_params(rows, vocab)
    seeds = torch.randint(1 << 62, (rows,))
    check_tokens(sample_tokens, logits, temps, top_k, top_p, min_p, seeds)
    check_tokens(sample_tokens, logits, temps, None, top_p, None, seeds)


@pytest.mark.parametrize("splits, block", [(1, None), (3, 16), (8, 32)])
def test_candidate_bound(splits, block):
    """The bound and the buffer: every token top-k / top-p keeps lies above c, n counts the
    tokens above c, and the buffer holds them in order, whatever the slicing; with a small
    k, far fewer than the vocabulary."""
    rows, vocab = 4, 3000
    x = 3 * torch.randn(rows, vocab)
    top_k = torch.tensor([5, 0, 0, 2999], dtype=torch.int32)
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.9])
    for has_k in (True, False):
        ws = sampling_fused.gather_candidates(x, torch.ones(rows), top_k if has_k else None, top_p, splits, block)
        kept = ~reference.top_k_top_p_min_p(x, top_k if has_k else None, top_p, None).isinf()
        for row in range(rows):
            c, n = ws["bound"][row, 0].item(), int(ws["bound"][row, 1])
            above = torch.nonzero(x[row] > c).flatten()
            assert n == len(above) and (x[row][kept[row]] > c).all()
            if n <= sampling_fused._CAPACITY:
                assert torch.equal(ws["indices"][row, :n].long(), above)
                assert torch.equal(ws["values"][row, :n], x[row, above])
        if has_k:
            assert ws["bound"][0, 1] < vocab / 10  # top_k = 5: a tight bound


def test_bound_masses_are_exact_over_slices():
    """The pivot table's masses are integer sums, so each slicing gives the same table: here
    a row whose top-p cut lies near a pivot's mass (many equal tokens) still gets one bound."""
    rows, vocab = 3, 2000
    x = torch.randn(rows, vocab).round()  # few distinct values: the masses above pivots are coarse
    top_p = torch.tensor([0.3, 0.6, 0.95])
    bounds = [
        sampling_fused.gather_candidates(x, torch.full((rows,), 0.9), None, top_p, s, b)["bound"]
        for s, b in [(1, None), (2, 64), (7, 16), (16, 16)]
    ]
    for b in bounds[1:]:
        assert torch.equal(b, bounds[0])


def filtered_rows(rows, vocab, dtype):
    """Logits with ties, a row masked to a few tokens, one all but flat; mixed parameters with
    greedy rows."""
    logits = 3 * torch.randn(rows, vocab)
    logits[1::3] = (logits[1::3] * 2).round() / 2  # many exact ties, across slices too
    if rows > 2:
        logits[2, :] = float("-inf")
        logits[2, [3, vocab // 2, vocab - 1]] = torch.tensor([1.0, 2.0, 1.0])  # in the first, a middle, the last slice
    if rows > 4:
        logits[4] = 0.01 * torch.randn(vocab)  # flat: top-p keeps most of the row
    params = mixed_params(max(rows, 8), vocab)
    pick = torch.arange(max(rows, 8)).roll(-4)[:rows]  # rows 4, 5, .. 0 (greedy), 1 (top-k 1), ..
    return logits.to(dtype), *(t[pick] for t in params)


@pytest.mark.parametrize("filters", ["k", "p", "min_p", "k_p", "k_p_min_p"])
@pytest.mark.parametrize(
    "rows, vocab, dtype, buffer",
    [(1, 301, torch.float32, 4096), (3, 257, torch.bfloat16, 4096), (9, 1001, torch.float16, 40)],
)
def test_split_rows_with_filters_same_tokens(filters, rows, vocab, dtype, buffer, monkeypatch):
    """Rows with top-k / top-p / min-p split over slices (odd sizes: the last slice is short;
    small blocks: several blocks a slice): the same tokens as one program per row, and as the
    reference up to rounding at a cut. A small buffer: the flat row, and others, overflow it."""
    monkeypatch.setattr(sampling_fused, "_CAPACITY", buffer)
    logits, temps, top_k, top_p, min_p = filtered_rows(rows, vocab, dtype)
    names = filters.split("_")
    args = (top_k if "k" in names else None, top_p if "p" in names else None, min_p if "min" in names else None)
    seeds = torch.randint(1 << 62, (rows,))
    one = sample_tokens(logits, temps, *args, seeds, splits=1)
    check_tokens(lambda *a: one, logits, temps, *args, seeds)
    for splits, block in [(2, None), (3, 16), (8, 32)]:
        assert torch.equal(sample_tokens(logits, temps, *args, seeds, splits=splits, block=block), one), splits


@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("vocab", [3000, 4097])
def test_split_rows_same_tokens(splits, vocab, dtype):
    """A few rows without top-k / top-p (without, then with min-p), each split over programs:
    the same tokens as one program per row (exactly: same noise, same scores, first index on
    ties), as the filter path and as the reference; greedy rows, a row with ties, a row masked
    to a few tokens, slices past the end."""
    rows = 3
    logits = (3 * torch.randn(rows, vocab)).to(dtype)
    logits[1] = (logits[1] * 2).round() / 2  # many exact ties, across slices too
    logits[2, :] = float("-inf")
    logits[2, [5, vocab - 1]] = 1.0  # two finite tokens, in the first and last slices
    temps = torch.tensor([0.0, 0.7, 1.3])
    seeds = torch.randint(1 << 62, (rows,))
    split = sampling_fused.split_sample(logits, temps, seeds, splits)
    assert torch.equal(split, sampling_fused.split_sample(logits, temps, seeds, 1))
    assert torch.equal(split, sample_tokens(logits, temps, None, None, None, seeds))
    four_launches = sample_tokens(logits, temps, None, torch.ones(rows), None, seeds)  # top-p 1: the filter path
    assert torch.equal(split, four_launches)
    check_tokens(lambda *a: split, logits, temps, None, None, None, seeds)
    greedy = torch.zeros(rows)
    assert torch.equal(sampling_fused.split_sample(logits, greedy, seeds, splits), logits.float().argmax(dim=-1))
    # min-p: the row maximum first, then the same one pass
    min_p = torch.tensor([0.1, 0.05, 0.3])
    split = sampling_fused.split_sample(logits, temps, seeds, splits, min_p)
    assert torch.equal(split, sampling_fused.split_sample(logits, temps, seeds, 1, min_p))
    assert torch.equal(split, sample_tokens(logits, temps, None, torch.ones(rows), min_p, seeds))
    check_tokens(lambda *a: split, logits, temps, None, None, min_p, seeds)


def test_rows_split_by_row_count(monkeypatch):
    calls = []
    monkeypatch.setattr(sampling_fused, "split_sample", lambda *a: calls.append(a[3]) or torch.zeros(1).long())
    for rows in (1, 64):
        logits, temps, seeds = torch.randn(rows, 20000), torch.ones(rows), torch.randint(1 << 62, (rows,))
        sample_tokens(logits, temps, None, None, None, seeds)
    assert calls == [4, 1]  # 8 "SMs" off the GPU: min(16 // rows, 20000 // 4096) -> 4, then 1
    gather = sampling_fused.gather_candidates
    monkeypatch.setattr(sampling_fused, "gather_candidates", lambda *a: calls.append(a[4]) or gather(*a))
    for rows in (1, 9):  # top-k: the filtered launches, split the same way
        logits, temps, seeds = torch.randn(rows, 20000), torch.ones(rows), torch.randint(1 << 62, (rows,))
        tokens = sample_tokens(logits, temps, torch.full((rows,), 5, dtype=torch.int32), None, None, seeds)
        assert (logits.gather(1, tokens[:, None]) >= logits.topk(5).values[:, -1:]).all()
    assert calls == [4, 1, 4, 1]
