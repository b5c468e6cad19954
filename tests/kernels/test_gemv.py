import pytest
import torch
import torch.nn.functional as F

from atom.ops.triton import gemv
from atom.ops.triton.gemv import GemvConfig, skinny_gemm

CONFIGS = [
    GemvConfig(block_n=8, block_k=32),
    GemvConfig(block_n=4, block_k=64, mode="defer"),
    GemvConfig(block_n=16, block_k=32, split_k=3),
    GemvConfig(block_n=16, block_k=16, mode="dot"),
    GemvConfig(block_n=32, block_k=32, split_k=2, mode="dot"),
    GemvConfig(block_n=16, block_k=32, split_k=2, mode="dot_t"),
]


def _config_id(c: GemvConfig) -> str:
    return f"{c.mode}-n{c.block_n}-k{c.block_k}-s{c.split_k}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=_config_id)
@pytest.mark.parametrize("m,n,k", [(1, 37, 100), (3, 64, 96), (7, 50, 130), (17, 33, 72)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_gemm(cfg, m, n, k, with_bias, dtype, assert_close):
    if cfg.mode.startswith("dot") and dtype == torch.float32:
        dtype = torch.bfloat16  # the dot mode is for 16-bit inputs (fp32 would run as tf32)
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype) / k**0.5
    bias = torch.randn(n, dtype=dtype) if with_bias else None
    out = skinny_gemm(x, w, bias, cfg)
    assert out.dtype == dtype
    ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert_close(out, ref, dtype)


def test_skinny_gemm_strided_rows(assert_close):
    x = torch.randn(5, 2 * 70, dtype=torch.bfloat16)[:, :70]  # rows 140 apart
    w = torch.randn(40, 70, dtype=torch.bfloat16)
    out = skinny_gemm(x, w, None, GemvConfig(block_n=8, block_k=32, split_k=2))
    assert_close(out, F.linear(x.double(), w.double()), torch.bfloat16)


@pytest.mark.parametrize("m,wide", [(1, False), (2, True), (5, True), (17, True)])
def test_linear_picks_the_skinny_kernel(m, wide, monkeypatch, assert_close):
    # a vocabulary-wide weight takes the kernel up to WIDE_MAX_ROWS rows: made 300 wide here
    monkeypatch.setattr(gemv, "WIDE_N", 300 if wide else 10**9)
    dtype = torch.float16
    x = torch.randn(1, m, 96, dtype=dtype)
    w = torch.randn(300, 96, dtype=dtype) / 10
    bias = torch.randn(300, dtype=dtype)
    assert gemv.use_skinny(x, w, bias)
    out = gemv.linear(x, w, bias)
    assert out.shape == (1, m, 300)
    assert_close(out, F.linear(x.double(), w.double(), bias.double()), dtype)
    cfg = gemv.pick_config(m, 300, 96)
    torch.testing.assert_close(out.view(m, 300), gemv.skinny_gemm(x.view(m, 96), w, bias, cfg), atol=0, rtol=0)


def test_linear_falls_back_to_torch():
    # more rows than MAX_ROWS (on a narrow weight), fp32, or empty input: F.linear itself
    w = torch.randn(24, 40)
    for x in (torch.randn(gemv.MAX_ROWS + 1, 40).half(), torch.randn(2, 40), torch.randn(0, 40).half()):
        ww = w.to(x.dtype)
        assert not gemv.use_skinny(x, ww, None)
        torch.testing.assert_close(gemv.linear(x, ww), F.linear(x, ww), atol=0, rtol=0)


@pytest.mark.parametrize("cfg", CONFIGS[:1] + CONFIGS[2:], ids=_config_id)
@pytest.mark.parametrize("m,n,k", [(1, 2 * 37, 100), (3, 2 * 32, 96), (2, 2 * 25, 130)])  # 37, 25: a part row block
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype16", [torch.bfloat16, torch.float16])
def test_skinny_gemm_gated(cfg, m, n, k, with_bias, dtype16, assert_close):
    # the activation in the epilogue (or the split-K reduction) of product rows that interleave gate and up
    # rows: the bits of the GEMM over a weight in that order, then silu_and_mul (an MMA's sums may depend on
    # a row's place in the tile, so not necessarily those of the GEMM over the weight as stored)
    from atom.ops import reference
    from atom.ops.triton.activation import silu_and_mul

    x = torch.randn(m, k, dtype=dtype16)
    w = (torch.randn(n, k) / k**0.5).to(dtype16)
    bias = torch.randn(n, dtype=dtype16) if with_bias else None
    out = skinny_gemm(x, w, bias, cfg, gated=True)
    assert out.shape == (m, n // 2) and out.dtype == dtype16
    order = torch.arange(n).view(2, n // 2).t().reshape(-1)  # gate 0, up 0, gate 1, up 1, ...
    product = skinny_gemm(x, w[order], None if bias is None else bias[order], cfg)
    torch.testing.assert_close(out, silu_and_mul(torch.cat([product[:, 0::2], product[:, 1::2]], 1)), atol=0, rtol=0)
    ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert_close(out, reference.silu_and_mul(ref), dtype16)


def test_skinny_gemm_gated_needs_pairs():
    x, w = torch.randn(1, 32, dtype=torch.bfloat16), torch.randn(64, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must be even"):
        skinny_gemm(x, w, None, GemvConfig(block_n=1, block_k=32), gated=True)
    with pytest.raises(ValueError, match="must be even"):
        skinny_gemm(x, w[:63], None, GemvConfig(block_n=2, block_k=32), gated=True)


@pytest.mark.parametrize("rows", [1, 2])
def test_gated_linear_fuses_up_to_its_row_count(rows, monkeypatch):
    # up to GATED_MAX_ROWS rows one gated skinny launch (block_n 1 widened to a pair), above it the
    # skinny kernel and silu_and_mul: the same bits either way
    from atom.ops.triton.activation import silu_and_mul

    monkeypatch.setattr(gemv, "MAX_ROWS", 2)
    x = torch.randn(1, rows, 96, dtype=torch.bfloat16)
    w = (torch.randn(2 * 40, 96) / 10).to(torch.bfloat16)
    ref = silu_and_mul(skinny_gemm(x.view(rows, 96), w, None, GemvConfig(block_n=1, block_k=32))).view(1, rows, 40)
    calls, skinny = [], gemv.skinny_gemm
    monkeypatch.setattr(gemv, "skinny_gemm", lambda *a, **kw: calls.append(kw.get("gated", False)) or skinny(*a, **kw))
    monkeypatch.setattr(gemv, "pick_config", lambda m, n, k: GemvConfig(block_n=1, block_k=32))
    monkeypatch.setattr(gemv, "GATED_MAX_ROWS", 1)
    out = gemv.gated_linear(x, w)
    assert out.shape == (1, rows, 40)
    assert calls == ([True] if rows == 1 else [False])
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
