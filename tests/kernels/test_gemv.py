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


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.mode}-n{c.block_n}-k{c.block_k}-s{c.split_k}")
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
