"""Temperature, top-k / top-p / min-p and the draw in one kernel (``atom.ops.sampling``).

One program per row. Usually the row is read three times: its statistics; one pass of
pivots evenly spaced over its value range, which bounds every kept token from below by the
highest pivot that top-k (or, without top-k, top-p) cannot cross; and a pass that copies
the tokens above that bound, in order, to a small per-row buffer. The exact threshold
searches (``sampling._filter_threshold``) and the draw then run on that buffer. A row
whose bound leaves more than ``_CAPACITY`` tokens (no top-k and a flat distribution) runs
them on the whole row instead. The kept set is decided on ``u = x / T`` rounded as torch
divides, from thresholds found on ``x`` (division preserves the order, ties included).

A few rows with no top-k, top-p or min-p (plain temperature or greedy: batch-1 decode) would
leave all but a few SMs idle, one SM reading a whole vocabulary row four times: such rows are
split over programs instead (``_split_kernel``), each racing its slice of the vocabulary once,
and a second launch takes the best of the slices. The Gumbel race is decomposable, and each
token's noise depends on its index only, so the tokens are the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.ops.triton.sampling import _argmax, _filter_threshold, _row_stats

_CAPACITY = 4096  # candidate tokens a row may keep in its buffer


@triton.jit
def _candidate_bound(
    row_ptr, vocab, row, row_min, row_max, num_finite, inv_temp, top_k_ptr, top_p_ptr,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr,
):  # fmt: skip
    """(c, n, total): every kept token is > c, and n tokens are. Top-k keeps only tokens
    above a pivot that at least k tokens exceed; without top-k, top-p keeps only tokens
    above a pivot whose mass above is at least top_p of ``total``, the row's mass (negative
    when top-k bounds: top-p then renormalises over what top-k keeps)."""
    offs_p = tl.arange(0, NUM_PIVOTS)
    pivots = row_min + (row_max - row_min) * (offs_p.to(tl.float32) / (NUM_PIVOTS - 1))
    count = tl.zeros([BLOCK, NUM_PIVOTS], tl.int32)
    mass = tl.zeros([BLOCK, NUM_PIVOTS], tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    k = 0
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row)
    if HAS_TOP_P:
        p = tl.load(top_p_ptr + row).to(tl.float32)
        # top-p renormalises over what top-k keeps, so with top-k only top-k's bound holds
        by_mass = (p < 1.0) & (k <= 0)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        u = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        gt = u[:, None] > pivots[None, :]
        count += gt.to(tl.int32)
        if HAS_TOP_P:
            if by_mass:
                w = tl.exp((u - row_max) * inv_temp)
                mass += tl.where(gt, w[:, None], 0.0)
                total += w
    count = tl.sum(count, axis=0)
    j = tl.zeros([], tl.int32)  # pivots [0, j) bound the kept tokens
    row_total = tl.sum(total, axis=0)
    if HAS_TOP_P:
        j = tl.where(by_mass, tl.sum((tl.sum(mass, axis=0) >= p * row_total).to(tl.int32), axis=0), 0)
    if HAS_TOP_K:
        j = tl.where(k > 0, tl.sum((count >= k).to(tl.int32), axis=0), j)
        row_total = tl.where(k > 0, -1.0, row_total)
    c = tl.max(tl.where(offs_p == j - 1, pivots, float("-inf")), axis=0)
    n = tl.where(j > 0, tl.sum(tl.where(offs_p == j - 1, count, 0), axis=0), num_finite)
    return c, n, row_total


@triton.jit
def _gather_above(row_ptr, vocab, c, val_ptr, idx_ptr, BLOCK: tl.constexpr):
    """Copy the tokens > c (values and indices, in order) to the buffer; their number and
    minimum."""
    base = tl.zeros([], tl.int32)
    low = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        u = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        sel = u > c
        num = tl.sum(sel.to(tl.int32), axis=0)
        if num > 0:
            pos = base + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(val_ptr + pos, u, mask=sel)
            tl.store(idx_ptr + pos, offs, mask=sel)
            low = tl.minimum(low, tl.where(sel, u, float("inf")))
            base += num
    return base, tl.min(low, axis=0)


@triton.jit
def _draw(
    val_ptr, idx_ptr, n, threshold, u_max, min_p, temp, seed,
    GATHERED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The Gumbel race over the kept tokens: the index maximising ``u - log(E)``. Token t's
    noise is word t % 4 of Philox at counter t // 4 (``atom.ops.sampling.philox_bits``)."""
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        u = tl.div_rn(tl.load(val_ptr + offs, mask=offs < n, other=float("-inf")).to(tl.float32), temp)
        keep = (u >= threshold) & (tl.exp(u - u_max) >= min_p)
        if tl.max(keep.to(tl.int32), axis=0) > 0:  # with top-k / top-p most blocks keep nothing
            if GATHERED:
                token = tl.load(idx_ptr + offs, mask=offs < n, other=0)
                r0, r1, r2, r3 = tl.randint4x(seed, token // 4)
                word = token % 4
                bits = tl.where(word == 0, r0, tl.where(word == 1, r1, tl.where(word == 2, r2, r3)))
            else:
                token = offs
                r0, r1, r2, r3 = tl.randint4x(seed, start // 4 + tl.arange(0, BLOCK // 4))
                bits = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK])
            # U = (top 23 bits + 1/2) / 2^23: exact, strictly inside (0, 1).
            unif = ((bits.to(tl.uint32, bitcast=True) >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
            score = tl.where(keep, u - tl.log(-tl.log(unif)), float("-inf"))
            better = score > best
            best = tl.where(better, score, best)
            best_idx = tl.where(better, token, best_idx)
    _, token = _argmax(best, best_idx, 2147483647)
    return token


@triton.jit
def _sample_kernel(
    logits_ptr, out_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, val_ptr, idx_ptr, vocab, stride_l,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
    BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr, CAPACITY: tl.constexpr,
):  # fmt: skip
    """One row: the argmax if its temperature is 0, else the Gumbel race over its kept tokens."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l
    row_max, row_min, num_finite, token = _row_stats(row_ptr, vocab, BLOCK)
    temp = tl.load(temp_ptr + row).to(tl.float32)
    if temp > 0:
        inv_temp = 1.0 / temp
        min_p = 0.0
        if HAS_MIN_P:
            min_p = tl.load(min_p_ptr + row).to(tl.float32)
        u_max = tl.div_rn(row_max, temp)
        seed = tl.load(seed_ptr + row)
        c, n, total = _candidate_bound(
            row_ptr, vocab, row, row_min, row_max, num_finite, inv_temp, top_k_ptr, top_p_ptr, HAS_TOP_K, HAS_TOP_P,
            BLOCK, NUM_PIVOTS,
        )  # fmt: skip
        if n <= CAPACITY:
            val_row, idx_row = val_ptr + row * CAPACITY, idx_ptr + row * CAPACITY
            n, low = _gather_above(row_ptr, vocab, c, val_row, idx_row, BLOCK)
            tl.debug_barrier()  # the buffer is written and read by different threads
            threshold = _filter_threshold(
                val_row, n, row, row_max, low, n, inv_temp, top_k_ptr, top_p_ptr, total, HAS_TOP_K, HAS_TOP_P,
                BLOCK, NUM_PIVOTS,
            )  # fmt: skip
            token = _draw(val_row, idx_row, n, tl.div_rn(threshold, temp), u_max, min_p, temp, seed, True, BLOCK)
        else:
            threshold = _filter_threshold(
                row_ptr, vocab, row, row_max, row_min, num_finite, inv_temp, top_k_ptr, top_p_ptr, -1.0,
                HAS_TOP_K, HAS_TOP_P, BLOCK, NUM_PIVOTS,
            )  # fmt: skip
            token = _draw(row_ptr, row_ptr, vocab, tl.div_rn(threshold, temp), u_max, min_p, temp, seed, False, BLOCK)
    tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def _split_kernel(logits_ptr, temp_ptr, seed_ptr, score_ptr, index_ptr, vocab, stride_l, chunk,
                  SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """The best (score, first index) of one slice of one row: the argmax of ``x`` for a greedy
    row, of ``x / T - log(E)`` (``_draw``'s noise) otherwise."""
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    row_ptr = logits_ptr + row * stride_l
    temp = tl.load(temp_ptr + row).to(tl.float32)
    seed = tl.load(seed_ptr + row)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, vocab)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        score = x
        if temp > 0:  # one Philox call per 4 tokens, as ``_draw`` (``start`` is a multiple of BLOCK)
            r0, r1, r2, r3 = tl.randint4x(seed, start // 4 + tl.arange(0, BLOCK // 4))
            bits = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK])
            unif = ((bits.to(tl.uint32, bitcast=True) >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
            score = tl.div_rn(x, temp) - tl.log(-tl.log(unif))
        better = score > best
        best = tl.where(better, score, best)
        best_idx = tl.where(better, offs, best_idx)
    best_score, token = _argmax(best, best_idx, 2147483647)
    tl.store(score_ptr + row * SPLITS + split, best_score)
    tl.store(index_ptr + row * SPLITS + split, token)


@triton.jit
def _best_split_kernel(score_ptr, index_ptr, out_ptr, SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = row * SPLITS + tl.arange(0, SPLITS)
    _, token = _argmax(tl.load(score_ptr + offs), tl.load(index_ptr + offs), 2147483647)
    tl.store(out_ptr + row, token.to(tl.int64))


def split_sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, splits: int) -> torch.Tensor:
    """``sample_tokens`` without top-k / top-p / min-p: one pass over each row (the Gumbel race
    needs no row maximum), split over ``splits`` programs (a power of two; 1: a wider program
    per row, for batches that fill the GPU by their rows alone)."""
    num_rows, vocab = logits.shape
    block, warps = (2048, 16) if splits == 1 else (1024, 4)
    chunk = triton.cdiv(triton.cdiv(vocab, splits), block) * block
    scores = torch.empty(num_rows, splits, dtype=torch.float32, device=logits.device)
    index = torch.empty(num_rows, splits, dtype=torch.int32, device=logits.device)
    _split_kernel[(num_rows, splits)](logits, temperatures, seeds, scores, index, vocab, logits.stride(0), chunk,
                                      SPLITS=splits, BLOCK=block, num_warps=warps)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    _best_split_kernel[(num_rows,)](scores, index, out, SPLITS=splits, num_warps=1)
    return out


def _splits(num_rows: int, vocab: int, device: torch.device) -> int:
    """Programs per row: about two per SM over the batch, each slice at least 4,096 tokens;
    1 (one program per row) once the rows alone fill the GPU."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = min(2 * sms // max(num_rows, 1), vocab // 4096, 64)
    return 1 << (want.bit_length() - 1) if want >= 2 else 1


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,
) -> torch.Tensor:
    """See ``atom.ops.sampling.sample_tokens``: no sort; rows without top-k / top-p / min-p
    in one pass (``split_sample``), the others one program per row."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    num_rows, vocab = logits.shape
    if num_rows > 0 and top_k is None and top_p is None and min_p is None:
        return split_sample(logits, temperatures, seeds, _splits(num_rows, vocab, logits.device))
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    capacity = _CAPACITY if top_k is not None or top_p is not None else 0
    values = torch.empty(num_rows, capacity, dtype=torch.float32, device=logits.device)
    indices = torch.empty(num_rows, capacity, dtype=torch.int32, device=logits.device)
    _sample_kernel[(num_rows,)](
        logits,
        out,
        temperatures,
        top_k if top_k is not None else temperatures,
        top_p if top_p is not None else temperatures,
        min_p if min_p is not None else temperatures,
        seeds,
        values,
        indices,
        vocab,
        logits.stride(0),
        HAS_TOP_K=top_k is not None,
        HAS_TOP_P=top_p is not None,
        HAS_MIN_P=min_p is not None,
        BLOCK=min(1024, max(16, triton.next_power_of_2(vocab))),
        NUM_PIVOTS=16,
        CAPACITY=capacity,
        num_warps=16,
    )
    return out
