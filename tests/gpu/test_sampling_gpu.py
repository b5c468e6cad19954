"""The fused sampling kernel at real vocabularies, on CUDA: token for token against the
reference (same Philox noise), and the frequencies of many draws against the filtered
distribution."""

import os

import pytest
import torch

from atom.ops import reference
from atom.testing.sampling_checks import check_tokens, rounding_sensitive

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton", allow_module_level=True)

from atom.ops.triton import sample_tokens  # noqa: E402

DEV = "cuda"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))


def mixed_params(rows, vocab):
    temps = torch.rand(rows, device=DEV) * 1.5 + 0.2
    top_k = torch.randint(0, 200, (rows,), device=DEV, dtype=torch.int32)
    top_p = torch.rand(rows, device=DEV) * 0.95 + 0.05
    min_p = torch.rand(rows, device=DEV) * 0.1
    for i, (t, k, p, m) in enumerate(
        [(0.0, 50, 0.9, 0.0), (1.0, 1, 1.0, 0.0), (0.7, 0, 0.999, 0.0), (1.0, 0, 1.0, 0.0)]
    ):
        if i < rows:
            temps[i], top_k[i], top_p[i], min_p[i] = t, k, p, m
    return temps, top_k, top_p, min_p


@pytest.mark.parametrize("vocab", [151936, 128256, 49152])
@pytest.mark.parametrize("rows", [1, 7, 64, 256])
def test_matches_reference(rows, vocab):
    logits = torch.randn(rows, vocab, device=DEV) * 3
    logits[-1] = logits[-1].bfloat16().float()  # many equal values
    seeds = torch.randint(1 << 62, (rows,), device=DEV)
    temps, top_k, top_p, min_p = mixed_params(rows, vocab)
    check_tokens(sample_tokens, logits, temps, top_k, top_p, min_p, seeds)
    check_tokens(sample_tokens, logits, temps, None, top_p, None, seeds)
    check_tokens(sample_tokens, logits, temps, top_k, None, None, seeds)


@pytest.mark.parametrize("vocab", [151936, 49152])
@pytest.mark.parametrize("rows", [1, 4, 8, 64, 256])
def test_plain_rows_split_over_programs(rows, vocab):
    """Rows without top-k / top-p run in one pass, a few rows split over programs: the same
    tokens as one program per row, as the filter path (top-p 1), and as the reference; with
    min-p too."""
    from atom.ops.triton.sampling_fused import _splits, split_sample

    logits = torch.randn(rows, vocab, device=DEV) * 3
    temps = torch.rand(rows, device=DEV) + 0.3
    temps[0] = 0.0
    seeds = torch.randint(1 << 62, (rows,), device=DEV)
    out = check_tokens(sample_tokens, logits, temps, None, None, None, seeds)
    assert _splits(rows, vocab, logits.device) > 1 or rows >= 64
    assert torch.equal(out, split_sample(logits, temps, seeds, 1))
    assert torch.equal(out, sample_tokens(logits, temps, None, torch.ones(rows, device=DEV), None, seeds))
    min_p = torch.rand(rows, device=DEV) * 0.2
    out = check_tokens(sample_tokens, logits, temps, None, None, min_p, seeds)
    assert torch.equal(out, split_sample(logits, temps, seeds, 1, min_p))
    assert torch.equal(out, sample_tokens(logits, temps, None, torch.ones(rows, device=DEV), min_p, seeds))


@pytest.mark.parametrize("top_k, top_p, min_p", [(20, 0.95, 0.0), (0, 0.8, 0.0), (50, 1.0, 0.05)])
def test_frequencies(top_k, top_p, min_p):
    n, vocab = 32768, 151936
    torch.manual_seed(0)  # one fixed draw: a failure reproduces
    base = torch.randn(vocab, device=DEV)
    base[:12] += torch.linspace(8, 5, 12, device=DEV)  # a head of likely tokens, a long tail
    logits, temps = base.expand(n, -1), torch.full((n,), 0.8, device=DEV)
    k, p, m = (torch.full((n,), v, device=DEV) for v in (top_k, top_p, min_p))
    k = k.to(torch.int32)
    seeds = torch.randint(1 << 62, (n,), device=DEV)
    tokens = sample_tokens(logits, temps, k, p, m, seeds)
    probs = reference.top_k_top_p_min_p((base / 0.8)[None], k[:1], p[:1], m[:1]).softmax(dim=-1)[0].double()
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    # a token whose fate hinges on float rounding at the top-p / min-p cut (tail tokens of
    # ~5e-6 probability each, the mass summed in a different order) may go either way
    sensitive = rounding_sensitive((base / 0.8)[None], k[:1], p[:1], m[:1])[0]
    assert (freq[(probs == 0) & ~sensitive] == 0).all()
    # such a token, when the kernel keeps it, is drawn at the probability it has among the kept
    plain = (base / 0.8).softmax(dim=-1).double()
    expect = torch.where(sensitive & (probs == 0), plain / plain[probs > 0].sum(), probs)
    # counts are binomial, near Poisson for the long kept tail (top-p 0.8 keeps ~10^5 tokens at
    # a few draws each): there the normal 6-sigma band is far too thin (a token expected 0.2
    # times is drawn 4 times in 1 of 20,000 cases), so the band gets 6 draws more, still far
    # below the head tokens' 6 sigma (~1,500 draws' worth at p 0.1)
    assert ((freq - expect).abs() <= 6 * (expect * (1 - expect) / n).sqrt() + 6 / n).all()


@pytest.mark.parametrize("filters", ["k_p", "p", "k", "k_p_min_p", "min_p"])
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16, 32, 64])
def test_filtered_rows_split_over_programs(rows, filters):
    """Rows with top-k / top-p / min-p split over slices when few (``_splits``): the same tokens
    as one program per row (``splits=1``) and as the reference up to rounding at a cut;
    greedy rows, ties, a masked row and a flat row (top-p past the buffer) among them."""
    from atom.ops.triton.sampling_fused import _splits

    vocab = 151936
    logits = torch.randn(rows, vocab, device=DEV) * 3
    logits[1::3] = logits[1::3].bfloat16().float()  # many equal values
    if rows > 2:
        logits[2, :] = float("-inf")
        logits[2, [3, vocab // 2, vocab - 1]] = 1.0
    if rows > 4:
        logits[4] *= 0.01  # flat: top-p keeps more than the buffer
    temps, top_k, top_p, min_p = mixed_params(rows, vocab)
    temps[-1] = 0.8  # a sampled row even at 1 row
    top_k[-1], top_p[-1] = 20, 0.95  # Qwen3's generation_config
    names = filters.split("_")
    args = (top_k if "k" in names else None, top_p if "p" in names else None, min_p if "min" in names else None)
    seeds = torch.randint(1 << 62, (rows,), device=DEV)
    out = check_tokens(sample_tokens, logits, temps, *args, seeds)
    assert _splits(rows, vocab, logits.device) > 1
    assert torch.equal(out, sample_tokens(logits, temps, *args, seeds, splits=1))
    assert torch.equal(out, sample_tokens(logits, temps, *args, seeds, splits=3))
