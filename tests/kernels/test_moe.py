import pytest
import torch

from atom.ops import reference
from atom.ops.triton import fused_moe, grouped_topk, moe_topk
from atom.ops.triton.moe import moe_sum


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 8, 2), (33, 16, 4), (7, 128, 8), (5, 60, 3)])
def test_moe_topk(num_tokens, num_experts, top_k, renormalize, dtype):
    logits = torch.randn(num_tokens, num_experts, dtype=dtype)
    weights, ids = moe_topk(logits, top_k, renormalize)
    ref_weights, ref_ids = reference.moe_topk(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
    # Ties (common in bf16 logits) may pick different experts of equal probability.
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    torch.testing.assert_close(probs.gather(1, ids), probs.gather(1, ref_ids))
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()


@pytest.mark.parametrize("num_tokens, top_k, hidden", [(1, 6, 2048), (9, 8, 1000), (3, 1, 64)])
def test_moe_sum(num_tokens, top_k, hidden, dtype):
    """The experts' outputs summed per token in float32, rounded once to the pairs' dtype."""
    pairs = torch.randn(num_tokens, top_k, hidden, dtype=dtype)
    out, exact = moe_sum(pairs), pairs.double().sum(dim=1)
    assert out.dtype == dtype
    # at most the final rounding (16-bit) or float32's accumulation error
    torch.testing.assert_close(out.double(), exact, rtol=2**-8 if dtype != torch.float32 else 1e-6, atol=1e-6)


# (experts, top_k, scoring, groups, topk_groups, bias, renormalize, scaling)
ROUTINGS = {
    "v2_lite_greedy": (64, 6, "softmax", 1, 1, False, False, 1.0),
    "v2_group_limited": (160, 6, "softmax", 8, 3, False, False, 16.0),
    "v3_noaux_tc": (256, 8, "sigmoid", 8, 4, True, True, 2.5),
    "kimi_k2": (384, 8, "sigmoid", 1, 1, True, True, 2.827),
    "moonlight": (64, 6, "sigmoid", 1, 1, True, True, 2.446),
    "small_groups": (12, 3, "sigmoid", 4, 2, True, False, 1.0),
}


@pytest.mark.parametrize("num_shared", [0, 2])
@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("routing", ROUTINGS.values(), ids=ROUTINGS.keys())
def test_grouped_topk(routing, num_tokens, num_shared):
    """DeepSeek's routing in one kernel against the reference: the same experts (as sets: the
    reference's top-k is unsorted) with the same weights, float32 logits as the gate gives; fused
    shared experts last, weight 1."""
    num_experts, top_k, scoring, groups, topk_groups, bias, renormalize, scaling = routing
    logits = torch.randn(num_tokens, num_experts) * 2
    correction = torch.randn(num_experts) * 0.5 if bias else None
    args = (top_k, scoring, groups, topk_groups, correction, renormalize, scaling, num_shared)
    weights, ids = grouped_topk(logits, *args)
    ref_weights, ref_ids = reference.grouped_topk(logits, *args)
    assert ids.shape == (num_tokens, top_k + num_shared)
    assert (ids[:, top_k:] == torch.arange(num_experts, num_experts + num_shared)).all()
    assert (weights[:, top_k:] == 1).all()
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    order, ref_order = ids.argsort(dim=1), ref_ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order), rtol=1e-5, atol=1e-6)
    if groups > 1:  # every pick from the chosen groups (V3: no expert of a dropped group)
        assert all(len(set((row // (num_experts // groups)).tolist())) <= topk_groups for row in ids[:, :top_k])


@pytest.mark.parametrize(
    "num_tokens, hidden, inter, num_experts, top_k",
    [
        (1, 64, 32, 8, 2),  # decode, single token
        (13, 128, 96, 16, 4),  # inter not a multiple of the column tile
        (150, 64, 64, 8, 2),  # enough pairs to pick the large-tile config
        (6, 96, 48, 32, 8),  # hidden not a power of two; most experts unused
    ],
)
def test_fused_moe(num_tokens, hidden, inter, num_experts, top_k, dtype, assert_close):
    x = torch.randn(num_tokens, hidden, dtype=dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter) / inter**0.5).to(dtype)
    weights, ids = reference.moe_topk(torch.randn(num_tokens, num_experts), top_k, True)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype
    # Reference in float32 on the same inputs, with the routing weights rounded like the kernel's.
    ref = reference.fused_moe(x.float(), w13.float(), w2.float(), weights.to(dtype).float(), ids)
    assert_close(out, ref, dtype, scale=2)


@pytest.mark.parametrize("num_pairs, num_experts, block_m", [(8, 64, 16), (96, 128, 16), (300, 8, 64), (1500, 64, 16)])
@pytest.mark.parametrize("sort_block", [1024, 4096])
def test_sort_by_expert_counts_in_the_sort_or_before(num_pairs, num_experts, block_m, sort_block, monkeypatch):
    """The sort counting the pairs itself (decode-sized batches) and after the counting kernel:
    the same layout, and the layout fused_moe expects (each expert's pairs in order, padded to
    its row tiles with the sentinel, the tiles' experts, the padded length). ``sort_block``: 1,500
    pairs in two steps of 1,024 on 4 warps, or in one of 2,048 on 8."""
    from atom.ops.triton import moe

    monkeypatch.setattr(moe, "SORT_BLOCK", sort_block)

    ids = torch.randint(0, num_experts, (num_pairs,))
    ids[: num_pairs // 3] = 5  # one busy expert, most others idle
    counts = torch.bincount(ids, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    expect_sorted, expect_experts = [], []
    for e in range(num_experts):
        rows = (ids == e).nonzero().flatten().tolist()
        expect_sorted += rows + [num_pairs] * (int(padded[e]) - len(rows))
        expect_experts += [e] * (int(padded[e]) // block_m)
    results = []
    for limit in (moe.SORT_COUNT_ELEMENTS, 0):  # as configured, then always the counting kernel
        monkeypatch.setattr(moe, "SORT_COUNT_ELEMENTS", limit)
        sorted_ids, expert_ids, num_padded = moe._sort_by_expert(ids, num_experts, block_m)
        total = int(num_padded)
        assert total == int(padded.sum())
        assert sorted_ids[:total].tolist() == expect_sorted
        assert expert_ids[: total // block_m].tolist() == expect_experts
        results.append(sorted_ids[:total])
    assert torch.equal(*results)


@pytest.mark.parametrize(
    "b_desc, group_m", [(False, 0), (True, 0), (False, 3)], ids=["pointers", "descriptor", "grouped"]
)
@pytest.mark.parametrize("num_tokens, hidden, inter", [(40, 128, 96), (9, 64, 32)])
def test_fused_moe_tile_configs(num_tokens, hidden, inter, b_desc, group_m, monkeypatch, assert_close):
    # Weight tiles through tensor descriptors, a down GEMM with its own column tile, an intermediate
    # size that is not a multiple of the column tile (rows past it are read), row tiles in groups
    # of three (the last one partial) taking the column tiles in turn.
    from atom.ops.triton import moe

    config = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2, b_desc=b_desc, GROUP_M=group_m,
                  down=dict(BLOCK_N=32))  # fmt: skip
    monkeypatch.setattr(moe, "_gemm_config", lambda *_: config)
    dtype = torch.bfloat16
    x = torch.randn(num_tokens, hidden, dtype=dtype)
    w13 = (torch.randn(8, 2 * inter, hidden) / hidden**0.5).to(dtype)
    w2 = (torch.randn(8, hidden, inter) / inter**0.5).to(dtype)
    weights, ids = reference.moe_topk(torch.randn(num_tokens, 8), 2, True)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = reference.fused_moe(x.float(), w13.float(), w2.float(), weights.to(dtype).float(), ids)
    assert_close(out, ref, dtype, scale=2)


@pytest.mark.parametrize(
    "num_tokens, hidden, inter, top_k, gated, down",
    [
        (1, 256, 96, 4, (8, 128), (4, 64)),  # inter not a multiple of the row block; 2 down key steps
        (2, 160, 64, 2, (4, 128), (16, 128)),  # hidden: a full and a partial key step (masked keys)
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_gemv(num_tokens, hidden, inter, top_k, gated, down, dtype, assert_close):
    # the few-token path on 16-bit experts (moe_gemv, unscaled): each pair's gate / up rows, silu * up
    # rounded as the tile kernel rounds, its down rows times its weight, summed by token
    from atom.ops.triton.fp8_gemv import Fp8GemvConfig
    from atom.ops.triton.moe_gemv import MoeGemvConfig

    x = torch.randn(num_tokens, hidden, dtype=dtype)
    w13 = (torch.randn(8, 2 * inter, hidden) / hidden**0.5).to(dtype)
    w2 = (torch.randn(8, hidden, inter) / inter**0.5).to(dtype)
    weights, ids = reference.moe_topk(torch.randn(num_tokens, 8), top_k, True)
    out = fused_moe(x, w13, w2, weights, ids, gemv=MoeGemvConfig(Fp8GemvConfig(*gated), Fp8GemvConfig(*down)))
    assert out.dtype == dtype
    ref = reference.fused_moe(x.float(), w13.float(), w2.float(), weights.to(dtype).float(), ids)
    assert_close(out, ref, dtype, scale=2)


def test_fused_moe_takes_the_gemv_up_to_its_token_count(monkeypatch):
    # up to moe.GEMV_MAX_TOKENS tokens 16-bit experts of up to GEMV_MAX_EXPERT_WEIGHTS run GEMV_CONFIG's
    # GEMVs (float32 ones, larger ones and more tokens the tile kernels): the GEMV launches recorded as they run
    from atom.ops.triton import moe

    x = torch.randn(2, 128, dtype=torch.bfloat16)
    w13 = (torch.randn(8, 128, 128) / 128**0.5).to(torch.bfloat16)
    w2 = (torch.randn(8, 128, 64) / 64**0.5).to(torch.bfloat16)
    weights, ids = reference.moe_topk(torch.randn(2, 8), 2, True)
    launches, gemv_pairs = [], moe.moe_gemv_pairs
    monkeypatch.setattr(moe, "moe_gemv_pairs", lambda *args: launches.append(args[5]) or gemv_pairs(*args))
    monkeypatch.setattr(moe, "GEMV_MAX_TOKENS", 2)
    out = fused_moe(x, w13, w2, weights, ids)
    assert launches == [moe.GEMV_CONFIG]
    assert torch.equal(out, moe.moe_sum(gemv_pairs(x, w13, w2, weights, ids, moe.GEMV_CONFIG)))
    fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    monkeypatch.setattr(moe, "GEMV_MAX_EXPERT_WEIGHTS", 3 * 128 * 64 - 1)  # experts one weight too large
    fused_moe(x, w13, w2, weights, ids)
    monkeypatch.setattr(moe, "GEMV_MAX_EXPERT_WEIGHTS", 3 * 128 * 64)
    monkeypatch.setattr(moe, "GEMV_MAX_TOKENS", 1)
    fused_moe(x, w13, w2, weights, ids)
    assert launches == [moe.GEMV_CONFIG]
    fused_moe(x[:1], w13, w2, weights[:1], ids[:1])
    assert launches == [moe.GEMV_CONFIG] * 2
