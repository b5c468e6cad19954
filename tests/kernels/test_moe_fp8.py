"""FP8 fused MoE kernel under the interpreter against ``reference_fp8.fused_moe_fp8``.

Both quantise the inputs identically, but the gate/up GEMM sums in a different order, so an
intermediate value may land on the other side of an e4m3 rounding boundary before the down
GEMM's quantisation: one step is 1/16 of that value. Hence a tolerance of 2% of the output's
magnitude rather than a few ulps (a wrong scale or expert is off by far more)."""

import pytest
import torch

from atom.ops import reference, reference_fp8
from atom.ops.triton import fp8_configs
from atom.ops.triton.fp8_configs import moe_config
from atom.ops.triton.fp8_gemv import Fp8GemvConfig
from atom.ops.triton.moe import moe_sum
from atom.ops.triton.moe_fp8 import fused_moe_fp8
from atom.ops.triton.moe_gemv import MoeGemvConfig, down_gemv, gated_gemv


@pytest.mark.parametrize(
    "num_tokens, hidden, inter, num_experts, top_k, group_k, dtype",
    [
        (1, 64, 32, 8, 2, 0, torch.float32),  # decode, per-channel
        (13, 128, 96, 16, 4, 32, torch.bfloat16),  # blocks; inter not a multiple of the column tile
        (70, 96, 64, 8, 2, 32, torch.float32),  # enough pairs for the larger tiles
        (6, 72, 40, 32, 8, 0, torch.bfloat16),  # partial key tiles; most experts unused
    ],
)
def test_fused_moe_fp8(num_tokens, hidden, inter, num_experts, top_k, group_k, dtype):
    x = torch.randn(num_tokens, hidden).to(dtype)
    pairs = [reference_fp8.quantize_weight(torch.randn(2 * inter, hidden) / hidden**0.5, group_k, group_k or 1)
             for _ in range(num_experts)]
    w13, s13 = torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
    pairs = [reference_fp8.quantize_weight(torch.randn(hidden, inter) / inter**0.5, group_k, group_k or 1)
             for _ in range(num_experts)]
    w2, s2 = torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
    weights, ids = reference.moe_topk(torch.randn(num_tokens, num_experts), top_k, True)
    out = fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, group_k)
    ref = reference_fp8.fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, group_k)
    assert out.dtype == dtype and not out.isnan().any()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 0.02 * max(1.0, ref.float().abs().max().item()), err


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("group_k", [32, 0])
def test_fused_moe_fp8_config_and_k_major_scales(group_k, paired):
    # a sweep candidate (its own down-GEMM tiles, a per-channel key tile narrower than K, row tiles
    # in groups of two with a partial last group; paired: gate and up in one dot, the last column
    # tile partly past the 96 columns) over K-major scales, the layout the FP8 MoE layer keeps after loading
    num_tokens, hidden, inter, num_experts, top_k = 13, 128, 96, 16, 4
    x = torch.randn(num_tokens, hidden).to(torch.bfloat16)
    weights_scales = []
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):
        pairs = [reference_fp8.quantize_weight(torch.randn(rows, cols) / cols**0.5, group_k, group_k or 1)
                 for _ in range(num_experts)]  # fmt: skip
        weights_scales += [torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])]
    w13, s13, w2, s2 = weights_scales
    k_major = [s.transpose(1, 2).contiguous().transpose(1, 2) for s in (s13, s2)]
    weights, ids = reference.moe_topk(torch.randn(num_tokens, num_experts), top_k, True)
    config = dict(BLOCK_M=16, BLOCK_N=64 if paired else 32, BLOCK_K=64, num_warps=4, num_stages=2, GROUP_M=2,
                  paired=paired, down=dict(BLOCK_N=64))  # fmt: skip
    out = fused_moe_fp8(x, w13, k_major[0], w2, k_major[1], weights, ids, group_k, config=config)
    ref = reference_fp8.fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, group_k)
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 0.02 * max(1.0, ref.float().abs().max().item()), err


def _experts(num_experts, hidden, inter, group_k):
    out = []
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):
        pairs = [reference_fp8.quantize_weight(torch.randn(rows, cols) / cols**0.5, group_k, group_k)
                 for _ in range(num_experts)]  # fmt: skip
        # the K-major scales the FP8 MoE layer keeps after loading
        out += [torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs]).transpose(1, 2).contiguous()
                .transpose(1, 2)]  # fmt: skip
    return out


@pytest.mark.parametrize(
    "num_tokens, hidden, inter, top_k, gated, down",
    [
        (1, 256, 96, 4, (16, 256), (16, 64)),  # inter not a multiple of the row block; 2 down key steps
        (3, 160, 64, 2, (8, 128), (32, 128)),  # hidden: 1 full and 1 partial key step (masked keys)
    ],
)
def test_fused_moe_fp8_gemv(num_tokens, hidden, inter, top_k, gated, down, assert_close):
    # the few-token path stage by stage, each against the reference layer on the same inputs: each pair's
    # gate / up rows through the CUDA-core GEMV (silu * up rounded as the tile kernel rounds), then its down
    # rows times its weight; end to end, a gated output a summation order off the reference's can land on
    # the other side of an e4m3 step of the down GEMM's input (1/16 of the value: several % of a small
    # test's output), so the stages are held to the bf16 tolerance one by one
    num_experts, group_k, dtype = 8, 32, torch.bfloat16
    x = (torch.randn(num_tokens, hidden) * torch.exp(torch.randn(num_tokens, 1))).to(dtype)
    w13, s13, w2, s2 = _experts(num_experts, hidden, inter, group_k)
    weights, ids = reference.moe_topk(torch.randn(num_tokens, num_experts), top_k, True)
    cfg = MoeGemvConfig(Fp8GemvConfig(*gated), Fp8GemvConfig(*down))
    pair_ids, pair_weights = ids.view(-1), weights.view(-1)
    h = gated_gemv(x, w13, pair_ids, top_k, cfg.gated, s13, group_k)
    expect = []
    for p, e in enumerate(pair_ids.tolist()):
        gate, up = reference_fp8.fp8_linear(x[p // top_k][None], w13[e], s13[e], group_k).chunk(2, dim=-1)
        expect.append(torch.nn.functional.silu(gate) * up)
    assert_close(h, torch.cat(expect), dtype)
    y = down_gemv(h, w2, pair_weights, pair_ids, cfg.down, s2, group_k)
    expect = [reference_fp8.fp8_linear(h[p][None], w2[e], s2[e], group_k) * pair_weights[p].to(dtype)
              for p, e in enumerate(pair_ids.tolist())]  # fmt: skip
    assert_close(y, torch.cat(expect), dtype)
    out = fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, group_k, config=cfg)
    assert torch.equal(out, moe_sum(y.view(num_tokens, top_k, hidden)))


def test_fused_moe_fp8_takes_the_gemv_for_few_tokens_of_small_experts(monkeypatch):
    # fp8_configs.moe_gemv_config picks the GEMVs up to MOE_GEMV_MAX_TOKENS tokens of experts of up to
    # MOE_GEMV_MAX_EXPERT_WEIGHTS weights (block scales only; Qwen3-30B-A3B's, V2-Lite's and 235B's, not V3's), the
    # tile kernels otherwise; 0 tokens turns the GEMVs off
    num_experts, hidden, inter, top_k, group_k = 8, 256, 64, 2, 128
    w13, s13, w2, s2 = _experts(num_experts, hidden, inter, group_k)
    n, pick = fp8_configs.MOE_GEMV_MAX_TOKENS, fp8_configs.moe_gemv_config
    assert n >= 1 and pick(n + 1, hidden, inter, 128) is None and pick(n, hidden, inter, 0) is None
    assert pick(1, 2048, 768, 128) is not None and pick(1, 7168, 2048, 128) is None
    assert pick(1, 2048, 1408, 128) is not None and pick(1, 4096, 1536, 128) is not None
    x = torch.randn(n, hidden).to(torch.bfloat16)
    weights, ids = reference.moe_topk(torch.randn(n, num_experts), top_k, True)
    picked = fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, group_k)
    cfg = pick(n, hidden, inter, group_k)
    assert torch.equal(picked, fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, group_k, config=cfg))
    tiles = fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, group_k, config=moe_config(n * top_k / 8, True))
    assert not torch.equal(picked, tiles)  # the GEMVs and the tiles sum in different orders
    monkeypatch.setattr(fp8_configs, "MOE_GEMV_MAX_TOKENS", 0)
    assert torch.equal(fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, group_k), tiles)
