"""Mixture-of-experts routing and the fused expert computation.

``fused_moe`` follows the usual Triton recipe: the (token, slot) pairs of ``topk_ids`` are
sorted by expert into segments padded to the GEMM row tile ``BLOCK_M``, so each row tile
of the grouped GEMMs belongs to a single expert. The first GEMM fuses ``silu_and_mul``
(each program computes matching gate and up columns); the second multiplies by the
routing weight; the per-pair outputs are then summed over the top-k slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from atom.ops.triton.activation import silu_mul
from atom.ops.triton.fp8_gemv import Fp8GemvConfig
from atom.ops.triton.moe_gemv import MoeGemvConfig, moe_gemv_pairs


@triton.jit
def _moe_topk_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + row * stride_l + offs_e, mask=offs_e < num_experts, other=float("-inf"))
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    # Padding experts get -1 so they are never picked, even over probabilities that underflow to 0.
    p = tl.where(offs_e < num_experts, p, -1.0)
    offs_k = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], tl.float32)
    top_id = tl.zeros([BLOCK_K], tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(p, axis=0)
        top_w = tl.where(offs_k == j, tl.max(p, axis=0), top_w)
        top_id = tl.where(offs_k == j, best, top_id)
        p = tl.where(offs_e == best, -2.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    tl.store(weights_ptr + row * TOP_K + offs_k, top_w, mask=offs_k < TOP_K)
    tl.store(ids_ptr + row * TOP_K + offs_k, top_id, mask=offs_k < TOP_K)


def moe_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    _moe_topk_kernel[(num_tokens,)](
        logits,
        weights,
        ids,
        num_experts,
        logits.stride(0),
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=4,
    )
    return weights, ids


@triton.jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, group_size, stride_l, scaling,
    TOP_K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NUM_GROUPS: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, RENORMALIZE: tl.constexpr, NUM_SHARED: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    # One program per token: scores, the group choice, top-k, renormalised weights; in float32.
    row = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    valid = offs_e < num_experts
    x = tl.load(logits_ptr + row * stride_l + offs_e, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        p = tl.exp(x - tl.max(x, axis=0))
        scores = p / tl.sum(p, axis=0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + offs_e, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))  # padding experts are never picked
    if NUM_GROUPS > 1 and TOPK_GROUPS < NUM_GROUPS:
        group = offs_e // group_size
        offs_g = tl.arange(0, BLOCK_G)
        group_scores = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            c = tl.where(group == g, choice, float("-inf"))
            best = tl.max(c, axis=0)
            if HAS_BIAS:  # V3: the sum of the group's two best
                best += tl.max(tl.where(offs_e == tl.argmax(c, axis=0), float("-inf"), c), axis=0)
            group_scores = tl.where(offs_g == g, best, group_scores)
        keep = offs_e < 0
        for _ in tl.static_range(TOPK_GROUPS):
            g = tl.argmax(group_scores, axis=0)
            keep = keep | (group == g)
            group_scores = tl.where(offs_g == g, float("-inf"), group_scores)
        # V2 zeroes the other groups' scores, V3 rules them out
        choice = tl.where(keep, choice, float("-inf") if HAS_BIAS else 0.0)
        choice = tl.where(valid, choice, float("-inf"))
    picked = scores if HAS_BIAS else choice  # the weights: unbiased scores
    offs_k = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], tl.float32)
    top_id = tl.zeros([BLOCK_K], tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=0)
        top_w = tl.where(offs_k == j, tl.sum(tl.where(offs_e == best, picked, 0.0), axis=0), top_w)
        top_id = tl.where(offs_k == j, best, top_id)
        choice = tl.where(offs_e == best, float("-inf"), choice)
    if RENORMALIZE:
        top_w = top_w / (tl.sum(top_w, axis=0) + 1e-20)
    # the fused shared experts after the routed ones, weight 1
    shared = (offs_k >= TOP_K) & (offs_k < TOP_K + NUM_SHARED)
    top_w = tl.where(shared, 1.0, top_w * scaling)
    top_id = tl.where(shared, num_experts + offs_k - TOP_K, top_id)
    width = TOP_K + NUM_SHARED
    tl.store(weights_ptr + row * width + offs_k, top_w, mask=offs_k < width)
    tl.store(ids_ptr + row * width + offs_k, top_id, mask=offs_k < width)


def grouped_topk(
    router_logits: torch.Tensor, top_k: int, scoring: str, num_groups: int, topk_groups: int,
    correction_bias: torch.Tensor | None, renormalize: bool, scaling: float, num_fused_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One launch for DeepSeek's routing (the reference: scores, group choice, top-k and
    weights as five to seven torch kernels), the fused shared experts' columns included."""
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"unknown expert scoring function {scoring!r} (expected 'sigmoid' or 'softmax')")
    num_tokens, num_experts = router_logits.shape
    width = top_k + num_fused_shared
    weights = torch.empty(num_tokens, width, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, width, dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    bias = correction_bias if correction_bias is not None else logits
    _grouped_topk_kernel[(num_tokens,)](
        logits, bias, weights, ids, num_experts, num_experts // num_groups, logits.stride(0), float(scaling),
        TOP_K=top_k, SIGMOID=scoring == "sigmoid", HAS_BIAS=correction_bias is not None, NUM_GROUPS=num_groups,
        TOPK_GROUPS=topk_groups, RENORMALIZE=renormalize, NUM_SHARED=num_fused_shared,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(width),
        BLOCK_G=triton.next_power_of_2(num_groups),
        num_warps=4 if num_experts > 128 else 2,
    )  # fmt: skip
    return weights, ids


@triton.jit(do_not_specialize=["num_pairs"])
def _count_experts_kernel(ids_ptr, counts_ptr, num_pairs, BLOCK: tl.constexpr):
    # One program per expert; the id list is small and stays in L2.
    expert = tl.program_id(0)
    count = tl.zeros([BLOCK], tl.int32)
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        count += (ids == expert).to(tl.int32)
    tl.store(counts_ptr + expert, tl.sum(count, axis=0))


@triton.jit(do_not_specialize=["num_pairs"])
def _sort_by_expert_kernel(
    ids_ptr,
    counts_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    num_experts,
    BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    COUNT: tl.constexpr,
):
    """Expert e writes its pair indices, in order, to its segment of ``sorted_ids``
    (segments are padded to ``BLOCK_M`` with the sentinel ``num_pairs``), and its expert
    id for each of its row tiles. ``COUNT``: every program counts all experts' pairs itself
    (all pairs in one ``BLOCK``: decode-sized batches) instead of reading ``counts_ptr``."""
    expert = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    if COUNT:
        offs = tl.arange(0, BLOCK)
        all_ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        counts = tl.sum((all_ids[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
        count = tl.sum(tl.where(offs_e == expert, counts, 0), axis=0)
    else:
        counts = tl.load(counts_ptr + offs_e, mask=offs_e < num_experts, other=0)
        count = tl.load(counts_ptr + expert)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    seg_start = tl.sum(tl.where(offs_e < expert, padded, 0), axis=0)
    seg_len = tl.cdiv(count, BLOCK_M) * BLOCK_M

    pos = seg_start
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        hit = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1) == expert
        rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1
        tl.store(sorted_ids_ptr + pos + rank, offs, mask=hit)
        pos += tl.sum(hit.to(tl.int32), axis=0)

    offs_m = tl.arange(0, BLOCK_M)
    tail = count + offs_m
    tl.store(sorted_ids_ptr + seg_start + tail, tl.full([BLOCK_M], 0, tl.int32) + num_pairs, mask=tail < seg_len)
    first_tile = seg_start // BLOCK_M
    for t in range(0, seg_len // BLOCK_M, BLOCK):
        offs = t + tl.arange(0, BLOCK)
        tl.store(expert_ids_ptr + first_tile + offs, tl.full([BLOCK], 0, tl.int32) + expert,
                 mask=offs < seg_len // BLOCK_M)  # fmt: skip
    if expert == 0:
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))


# the most (pairs x experts) comparisons a program of the sort makes to count the pairs itself:
# 16 x 8 routes over 128 experts (Qwen3-30B-A3B at batch 16), 64 over 256
SORT_COUNT_ELEMENTS = 16384
# the most pairs a step of the count and sort programs' loops takes (4 warps a 1,024): each expert's program
# walks all pairs step by step. 4,096 (16 warps): sort + count 28 -> 17 us at 2,048 tokens of Qwen3-30B-A3B,
# 104 -> 58 at 8,192 (vLLM's 14 / 42; H200, session 31, `moe_profile.py --fp8 --sort-blocks`)
SORT_BLOCK = 4096


def _sort_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Returns (sorted pair indices padded per expert, expert of each row tile, [padded length])."""
    num_pairs = topk_ids.numel()
    ids = topk_ids.reshape(-1)
    device = topk_ids.device
    max_padded = num_pairs + num_experts * (block_m - 1)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(triton.cdiv(max_padded, block_m), dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    block = min(triton.next_power_of_2(num_pairs), SORT_BLOCK)
    warps = max(4, block // 256)
    block_e = triton.next_power_of_2(num_experts)
    # few pairs (decode): the sort counts them itself, one launch fewer a layer
    fused_count = num_pairs <= block and block * block_e <= SORT_COUNT_ELEMENTS
    counts = sorted_ids  # unread when fused_count
    if not fused_count:
        counts = torch.empty(num_experts, dtype=torch.int32, device=device)
        _count_experts_kernel[(num_experts,)](ids, counts, num_pairs, BLOCK=block, num_warps=warps)
    _sort_by_expert_kernel[(num_experts,)](
        ids,
        counts,
        sorted_ids,
        expert_ids,
        num_padded,
        num_pairs,
        num_experts,
        BLOCK=block,
        BLOCK_E=block_e,
        BLOCK_M=block_m,
        COUNT=fused_count,
        num_warps=warps,
    )
    return sorted_ids, expert_ids, num_padded


@triton.jit
def _tile_ids(num_m, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (row tile, column tile) in the MoE GEMM kernels' 1D grid. ``GROUP_M`` row tiles take
    every column tile before the next ``GROUP_M`` start (Triton's grouped order: a group's gathered rows
    of ``a`` stay in L2 across the column tiles, as vLLM's ``GROUP_SIZE_M``); 0: all ``num_m`` row tiles
    of one column tile, then the next."""
    pid = tl.program_id(0)
    if GROUP_M == 0:
        return pid % num_m, pid // num_m
    in_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def _row_tile(
    a_ptr, b_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs, N, stride_am, stride_be, stride_bn, pid_m, pid_n,
    A_ROW_DIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Where tile (pid_m, pid_n) of the MoE GEMM kernels (``moe`` and ``moe_fp8``) starts: its pairs, which
    of them are real (not padding), their rows of ``a``, the tile's expert, its columns and which are
    inside ``N``, the K offsets, and the pointers of the first K tiles of ``a`` and ``b``."""
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    # b[expert] is [N_total, K] row-major; load it as [BLOCK_K, BLOCK_N] tiles.
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    return pairs, pairs < num_pairs, a_rows, expert, offs_n, offs_n < N, offs_k, a_ptrs, b_ptrs


@triton.jit
def _paired_rows(b_ptr, expert, stride_be, stride_bn, offs_k, pid_n, N, BLOCK_N: tl.constexpr):
    """The gated GEMM's weight rows for one dot over gate and up (``PAIRED`` in the FP8 MoE GEMM kernel):
    column 2j of the [BLOCK_K, 2 x BLOCK_N] tile is gate row j of column tile ``pid_n``, column 2j + 1 up
    row j, so each thread's accumulator holds a gate and its up side by side and ``tl.split`` of the
    [BLOCK_M, BLOCK_N, 2] reshape parts them in registers. Returns the rows, which are inside N, and the
    pointers of the first K tile."""
    j = tl.arange(0, 2 * BLOCK_N)
    rows = pid_n * BLOCK_N + j // 2
    ok = rows < N
    rows += (j % 2) * N
    return rows, ok, b_ptr + expert * stride_be + rows[None, :].to(tl.int64) * stride_bn + offs_k[:, None]


@triton.jit
def _store_tile(c_ptr, stride_cm, weights_ptr, acc, acc_up, pairs, row_ok, offs_n, n_ok, GATED: tl.constexpr,
                MUL_WEIGHT: tl.constexpr):  # fmt: skip
    """Store the tile of the MoE GEMM kernels: ``silu(acc) * acc_up`` when GATED, times the pairs' routing
    weights when MUL_WEIGHT."""
    dtype = c_ptr.dtype.element_ty
    # Round where the reference rounds: each GEMM output, silu, and the weighted product.
    if GATED:
        res = silu_mul(acc, acc_up, dtype)
    else:
        res = acc.to(dtype).to(tl.float32)
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(dtype).to(tl.float32)
        res = res * w[:, None]
    c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, res.to(dtype), mask=row_ok[:, None] & n_ok[None, :])


# ``num_pairs`` (tokens x top-k) changes every batch: specialised on divisibility by 16 it would
# compile a second variant of each kernel for odd token counts, in the middle of a step.
@triton.jit(do_not_specialize=["num_pairs", "num_m"])
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    N,
    K,
    num_pairs,
    num_m,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    b_desc,
    A_ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    B_DESC: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``c[pair] = a[pair // A_ROW_DIV] @ b[expert].T`` for the pairs of one row tile.
    GATED: ``b`` holds gate rows then up rows (N each) and c gets ``silu(gate) * up``.
    MUL_WEIGHT: c is scaled by the pair's routing weight. B_DESC: ``b`` tiles come through
    ``b_desc`` (a tensor descriptor over b as [experts * rows, K]: bulk tensor copies);
    rows past N are read but their columns are never stored. ``num_m``: row tiles (``_tile_ids``).
    Gate and up in one dot (``_paired_rows``, as the FP8 kernel) lost 0.5-12% at every size (H200,
    session 31, `kernel_sweep.py moe moe_small`)."""
    pid_m, pid_n = _tile_ids(num_m, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs, row_ok, a_rows, expert, offs_n, n_ok, offs_k, a_ptrs, b_ptrs = _row_tile(
        a_ptr, b_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs, N, stride_am, stride_be, stride_bn, pid_m, pid_n,
        A_ROW_DIV, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    desc_row = (expert * (2 * N if GATED else N)).to(tl.int32) + pid_n * BLOCK_N
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if B_DESC:
            b = b_desc.load([desc_row, k0]).T
        else:
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            if B_DESC:
                b_up = b_desc.load([desc_row + N, k0]).T
            else:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    _store_tile(c_ptr, stride_cm, weights_ptr, acc, acc_up, pairs, row_ok, offs_n, n_ok, GATED, MUL_WEIGHT)


def _gemm_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> dict:
    """Tile shapes by rows per expert, picked by tests/gpu/kernel_sweep.py
    on an H200: small (decode) batches are bound by reading the expert weights and want
    thin row tiles; large batches want square tensor-core tiles. float32 tiles are twice
    the bytes, so pipeline fewer stages to stay within shared memory."""
    rows = num_pairs / num_experts
    if dtype.itemsize == 4:
        return dict(BLOCK_M=16 if rows <= 16 else 64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=2)
    if rows <= 0.25:  # 1-4 tokens of 128 experts, top-8: the GEMMs' fixed costs dominate; two warps and
        # more programs take 4-6% off (H200, session 29: 31.6 -> 29.7 us at one token, most in the gated GEMM)
        down = dict(BLOCK_N=64, num_warps=2)
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=2, num_stages=4, down=down, b_desc=True)
    if rows <= 4:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    if rows <= 16:
        return dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)
    if rows <= 32:  # 512 tokens, top-8 of 128 experts: 14% faster than the 32 x 64 x 128 tile (3% at 256 of
        # V2-Lite's 64 experts, top-6), at vLLM's speed (H200, session 30, `kernel_sweep.py moe`)
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, b_desc=True)
    # The gated GEMM's two 128-column tiles are one 256-column MMA tile; the down GEMM gets
    # 256 columns itself (8% faster at 2048-8192 tokens on an H100), and weight tiles come
    # through tensor descriptors (another 2-9%). H200, session 30: from 96 rows per expert (1,024 tokens of
    # V2-Lite's experts) 24% faster than the 64 x 128 tile; the row tiles in groups of 16 5% faster at 2,048
    # tokens of 128 experts, the same at 4,096-8,192.
    down = dict(BLOCK_N=256, num_warps=8, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, GROUP_M=16, down=down, b_desc=True)


def _moe_gemm(a, b, c, weights, sorted_ids, expert_ids, num_padded, n, a_row_div, gated, config):
    grid = (expert_ids.shape[0] * triton.cdiv(n, config["BLOCK_N"]),)
    b_desc = None
    # The bulk copy engine needs 16-byte aligned rows and base.
    if config.get("b_desc") and (b.shape[2] * b.element_size()) % 16 == 0 and b.data_ptr() % 16 == 0:
        rows, k = b.shape[0] * b.shape[1], b.shape[2]
        b_desc = TensorDescriptor(b, [rows, k], [k, 1], [config["BLOCK_N"], config["BLOCK_K"]])
    _moe_gemm_kernel[grid](
        a,
        b,
        c,
        weights,
        sorted_ids,
        expert_ids,
        num_padded,
        n,
        b.shape[2],
        c.shape[0],
        expert_ids.shape[0],
        a.stride(0),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        b_desc,
        A_ROW_DIV=a_row_div,
        GATED=gated,
        MUL_WEIGHT=not gated,
        DOT_PRECISION="tf32x3" if a.dtype == torch.float32 else "tf32",
        B_DESC=b_desc is not None,
        GROUP_M=config.get("GROUP_M", 0),
        **{k: v for k, v in config.items() if k not in ("down", "b_desc", "GROUP_M")},
    )


# Up to this many tokens a 16-bit MoE runs the CUDA-core GEMVs (moe_gemv) with GEMV_CONFIG: no sort launches
# and no 16-row tiles holding one real row an expert (the FP8 experts' rule: fp8_configs.moe_gemv_config).
# H200, session 35 (`kernel_sweep.py moe_gemv`, us, fastest of 7 launches / tiles / vLLM's fused_experts):
# Qwen3-30B-A3B's experts at 1 token 30.2 / 31.9 / 33.1, 2 tokens 50.6 / 52.0 / 52.6; DeepSeek-V2-Lite's at 1
# token 36.6 / 39.8 / 40.9, 2 tokens 63.9 / 63.3 / 66.1. End to end at batch 1 more than that (the launches
# it saves): Qwen3-30B-A3B TPOT 3.185 ms against 3.479 with the tiles, V2-Lite 2.497 against 2.522. Larger
# experts (gate, up and down over GEMV_MAX_EXPERT_WEIGHTS) stay on the tiles: at one token Qwen3-235B-A22B's
# (18.9 M weights) 92.6 us on the GEMVs against 94.0, DeepSeek-V3's (44 M) 193.9 against 190.3.
GEMV_MAX_TOKENS = 1
GEMV_MAX_EXPERT_WEIGHTS = 1 << 25
GEMV_CONFIG = MoeGemvConfig(
    Fp8GemvConfig(block_n=2, block_k=1024, num_warps=2), Fp8GemvConfig(block_n=4, block_k=256, num_warps=2)
)


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    gemv: MoeGemvConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """``reference.fused_moe`` on the tile kernels, or on the GEMVs (``moe_gemv``) with launch ``gemv``
    or up to ``GEMV_MAX_TOKENS`` tokens of experts up to ``GEMV_MAX_EXPERT_WEIGHTS``."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter_size = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(x)
    small = num_tokens <= GEMV_MAX_TOKENS and 3 * hidden * inter_size <= GEMV_MAX_EXPERT_WEIGHTS
    if gemv is None and small and w13.dtype == x.dtype and x.dtype != torch.float32:
        gemv = GEMV_CONFIG
    if gemv is not None:
        return moe_sum(moe_gemv_pairs(x.contiguous(), w13, w2, topk_weights, topk_ids, gemv))
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    weights = topk_weights.contiguous().view(-1)
    config = _gemm_config(num_pairs, num_experts, x.dtype)
    sorted_ids, expert_ids, num_padded = _sort_by_expert(topk_ids, num_experts, config["BLOCK_M"])
    inter = torch.empty(num_pairs, inter_size, dtype=x.dtype, device=x.device)
    _moe_gemm(x, w13, inter, weights, sorted_ids, expert_ids, num_padded, inter_size, top_k, True, config)
    out_pairs = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    down = {**config, **config.get("down", {})}  # the down GEMM may use wider tiles (same BLOCK_M)
    _moe_gemm(inter, w2, out_pairs, weights, sorted_ids, expert_ids, num_padded, hidden, 1, False, down)
    return moe_sum(out_pairs.view(num_tokens, top_k, hidden))


@triton.jit
def _moe_sum_kernel(x_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    token, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(x_ptr + (token * TOP_K + j) * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum(pairs: torch.Tensor) -> torch.Tensor:
    """``pairs.sum(dim=1)`` for contiguous [T, k, H] expert outputs, accumulated in float32 as
    torch does: torch's reduction kernel ran this at ~1 TB/s on an H200 (210 us a layer for an
    8k-token DeepSeek-V2-Lite prompt step; 4.8 us at batch 1)."""
    num_tokens, top_k, hidden = pairs.shape
    out = torch.empty(num_tokens, hidden, dtype=pairs.dtype, device=pairs.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block))](pairs, out, hidden, TOP_K=top_k, BLOCK=block,
                                                              num_warps=4)  # fmt: skip
    return out
