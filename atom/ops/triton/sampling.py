"""Top-k / top-p / min-p masking without sorting the vocabulary.

Each filter keeps the tokens at or above a per-row threshold value. Both top-k and top-p
have the form "keep token v iff G(v) < W", where G(x) is the weight of the tokens strictly
greater than x: weight 1 and W = k for top-k; weight exp(v - max) over the top-k survivors
and W = top_p * (their total) for top-p. G only falls as x grows, so the threshold is the
smallest token value with G(v) < W, found by a bracket search over the value range:
each pass over the row evaluates G at NUM_PIVOTS evenly spaced pivots (and, for each, the
smallest token above it) and narrows the bracket to one pivot interval. It stops exactly
once no token lies strictly inside that interval, so the kept set equals the reference's
(equal values share one fate there too) up to float rounding of the probability sums.

One program handles one row; on a GPU, batches of fewer than ``_MIN_ROWS`` rows go to the
sort-based reference instead. ``sampling_fused`` reuses these helpers for the sampler.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.ops import reference

# One program per row keeps a single SM busy per row, so for a few rows a sort over the
# whole GPU wins (H200: the sort takes 0.17 ms for one 152k-vocab row, and the kernel's
# ~9 passes over the row from one SM take longer); from this many rows on, the kernel.
_MIN_ROWS = 16


@triton.jit
def _threshold(
    row_ptr,
    vocab,
    lo,
    hi,
    floor,
    row_max,
    inv_temp,
    limit,
    active,
    USE_MASS: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    """Smallest token value v with G(v) < limit, where G(x) sums the weight of the tokens
    u > x with u >= floor (weight 1, or exp(u - row_max) if USE_MASS); ``floor`` when not
    ``active``. ``lo`` must be a token value (the answer if G(lo) < limit), ``hi`` the max."""
    offs_p = tl.arange(0, NUM_PIVOTS)
    t = tl.where(active, hi, floor)
    searching = active & (lo < hi)
    passes: tl.int32 = 0
    # The bracket shrinks NUM_PIVOTS - 1 fold per pass and closes at the latest when its
    # ends are adjacent floats; the cap only guards against non-finite inputs.
    while searching:
        pivots = lo + (hi - lo) * (offs_p.to(tl.float32) / (NUM_PIVOTS - 1))
        pivots = tl.where(offs_p == NUM_PIVOTS - 1, hi, pivots)
        g = tl.zeros([BLOCK, NUM_PIVOTS], tl.float32)
        above = tl.full([BLOCK, NUM_PIVOTS], float("inf"), tl.float32)
        # Tokens above hi count for every pivot and tokens at or below lo for none, so only
        # blocks with a token inside (lo, hi] (after the first pass: few) pay per pivot.
        g_hi = tl.zeros([BLOCK], tl.float32)
        above_hi = tl.full([BLOCK], float("inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            u = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
            if USE_MASS:
                w = tl.where(u >= floor, tl.exp((u - row_max) * inv_temp), 0.0)
            else:
                w = tl.where(u >= floor, 1.0, 0.0)
            g_hi += tl.where(u > hi, w, 0.0)
            above_hi = tl.minimum(above_hi, tl.where(u > hi, u, float("inf")))
            inside = (u > lo) & (u <= hi)
            if tl.max(inside.to(tl.int32), axis=0) > 0:
                gt = inside[:, None] & (u[:, None] > pivots[None, :])
                g += tl.where(gt, w[:, None], 0.0)
                above = tl.minimum(above, tl.where(gt, u[:, None], float("inf")))
        g = tl.sum(g, axis=0) + tl.sum(g_hi, axis=0)
        above = tl.minimum(tl.min(above, axis=0), tl.min(above_hi, axis=0))
        # Pivots [0, j) have G >= limit, so their tokens (and all below) are dropped; from
        # pivot j up, all tokens are kept. The threshold lies in (pivot[j-1], pivot[j]].
        j = tl.sum((g >= limit).to(tl.int32), axis=0)
        new_lo = tl.max(tl.where(offs_p == j - 1, pivots, float("-inf")), axis=0)
        new_hi = tl.max(tl.where(offs_p == j, pivots, float("-inf")), axis=0)
        first_above = tl.max(tl.where(offs_p == j - 1, above, float("-inf")), axis=0)
        # j == 0 happens only on the first pass (later pivot 0 is a dropped end): lo is kept.
        # j == NUM_PIVOTS means limit <= 0 (top_p = 0): only the maximum survives.
        # Otherwise, once no token lies strictly inside the interval, the smallest token
        # above pivot[j-1] is the threshold.
        t = tl.where(j == 0, lo, tl.where(j == NUM_PIVOTS, hi, first_above))
        passes += 1
        searching = (j > 0) & (j < NUM_PIVOTS) & (first_above < new_hi) & (passes < 64)
        lo = new_lo
        hi = new_hi
    return t


@triton.jit
def _row_stats(row_ptr, vocab, BLOCK: tl.constexpr):
    """Max, smallest finite value, number of finite values, and the first index of the max."""
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    row_min = tl.full([BLOCK], float("inf"), tl.float32)
    finite = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        u = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        ok = u > float("-inf")
        better = u > best
        best = tl.where(better, u, best)
        best_idx = tl.where(better, offs, best_idx)
        row_min = tl.minimum(row_min, tl.where(ok, u, float("inf")))
        finite += ok.to(tl.int32)
    row_max, argmax = _argmax(best, best_idx, vocab)
    return row_max, tl.min(row_min, axis=0), tl.sum(finite, axis=0), argmax


@triton.jit
def _argmax(best, best_idx, vocab):
    """Reduce per-lane running maxima (each lane's first index of its max) to the row's
    max and its first index, as ``torch.argmax``."""
    row_max = tl.max(best, axis=0)
    return row_max, tl.min(tl.where(best == row_max, best_idx, vocab), axis=0)


@triton.jit
def _filter_threshold(
    row_ptr, vocab, row, row_max, row_min, num_finite, inv_temp, top_k_ptr, top_p_ptr, total_mass,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr,
):  # fmt: skip
    """The smallest value top-k and top-p keep (-inf when they keep everything), judged on
    ``u * inv_temp`` (only the mass weights depend on the temperature: dividing by it
    preserves the order). ``total_mass``: top-p's normaliser if known, else negative (then
    summed here over what top-k keeps)."""
    threshold = float("-inf")
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row)
        threshold = _threshold(
            row_ptr, vocab, row_min, row_max, float("-inf"), row_max, inv_temp, k.to(tl.float32),
            (k > 0) & (k < num_finite), False, BLOCK, NUM_PIVOTS,
        )  # fmt: skip
    if HAS_TOP_P:
        p = tl.load(top_p_ptr + row).to(tl.float32)
        # Top-p renormalises over what top-k kept.
        total = tl.zeros([BLOCK], tl.float32)
        for start in range(0, tl.where((p < 1.0) & (total_mass < 0), vocab, 0), BLOCK):
            offs = start + tl.arange(0, BLOCK)
            u = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
            total += tl.where(u >= threshold, tl.exp((u - row_max) * inv_temp), 0.0)
        threshold = _threshold(
            row_ptr, vocab, tl.maximum(threshold, row_min), row_max, threshold, row_max, inv_temp,
            p * tl.where(total_mass < 0, tl.sum(total, axis=0), total_mass), p < 1.0, True, BLOCK, NUM_PIVOTS,
        )  # fmt: skip
    return threshold


@triton.jit
def _top_k_top_p_min_p_kernel(
    logits_ptr,
    out_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    vocab,
    stride_l,
    stride_o,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l
    row_max, row_min, num_finite, _ = _row_stats(row_ptr, vocab, BLOCK)
    threshold = _filter_threshold(
        row_ptr, vocab, row, row_max, row_min, num_finite, 1.0, top_k_ptr, top_p_ptr, -1.0,
        HAS_TOP_K, HAS_TOP_P, BLOCK, NUM_PIVOTS,
    )  # fmt: skip
    # min-p: prob >= min_p * max_prob  <=>  exp(v - max) >= min_p (the normaliser cancels).
    min_p = 0.0
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + row).to(tl.float32)

    out_row = out_ptr + row * stride_o
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf"))
        u = x.to(tl.float32)
        keep = (u >= threshold) & (tl.exp(u - row_max) >= min_p)
        tl.store(out_row + offs, tl.where(keep, x, float("-inf")), mask=offs < vocab)


def top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """See ``atom.ops.reference.top_k_top_p_min_p``. Probabilities are computed in float32
    whatever the logits dtype."""
    if logits.is_cuda and logits.shape[0] < _MIN_ROWS:
        return reference.top_k_top_p_min_p(logits.float(), top_k, top_p, min_p).to(logits.dtype)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty_like(logits)
    num_rows, vocab = logits.shape
    if num_rows == 0:
        return out
    _top_k_top_p_min_p_kernel[(num_rows,)](
        logits,
        out,
        top_k if top_k is not None else logits,
        top_p if top_p is not None else logits,
        min_p if min_p is not None else logits,
        vocab,
        logits.stride(0),
        out.stride(0),
        HAS_TOP_K=top_k is not None,
        HAS_TOP_P=top_p is not None,
        HAS_MIN_P=min_p is not None,
        BLOCK=1024,
        NUM_PIVOTS=16,
        num_warps=16,
    )
    return out
