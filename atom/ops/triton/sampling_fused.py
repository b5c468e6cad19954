"""Temperature, top-k / top-p / min-p and the draw without a sort (``atom.ops.sampling``).

Rows with top-k or top-p run in four launches; the first three split each row into slices
of the vocabulary, one program each (``_splits``: many slices when the rows are fewer than
the SMs, one per row once the rows fill the GPU), where one program per row would read the
whole row several times from one SM:

1. ``_stats_kernel``: each slice's max (and its first index), smallest finite value and
   number of finite values.
2. ``_pivot_kernel``: pivots evenly spaced over the row's value range and, for each, the
   slice's number of tokens above it and (top-p without top-k) their mass, in fixed point.
3. ``_gather_kernel``: every program of a row sums the slices' tables and picks the bound
   c: the highest pivot that top-k (or, without top-k, top-p) cannot cross, so every kept
   token is above it. Each slice copies its tokens above c, in order, to the row's buffer
   of ``_CAPACITY`` tokens, after those of the slices before it (their counts above c are in
   the tables).
4. ``_finish_kernel``, one program per row: the exact threshold searches
   (``sampling._filter_threshold``) and the draw on the buffer. A row whose bound leaves more
   than ``_CAPACITY`` tokens (no top-k and a flat distribution) runs them on the whole row
   instead.

The tokens do not depend on the number of slices: the statistics, the counts and the fixed
point masses combine exactly (integer sums, max, min), so every slicing gathers the same
buffer, and the float arithmetic (the search on the buffer, the draw) is the same kernel. The
kept set is decided on ``u = x / T`` rounded as torch divides, from thresholds found on ``x``
(division preserves the order, ties included).

Rows with no top-k or top-p (plain temperature, min-p, greedy) race their slices in one
pass (``split_sample``, one program per slice when the rows are few; min-p needs the row's
maximum first, ``amax``) and a second launch takes the best slice. The Gumbel race is
decomposable, and each token's noise depends on its index only, so the tokens are the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.ops.triton.sampling import _argmax, _filter_threshold, _row_stats

_CAPACITY = 4096  # candidate tokens a row may keep in its buffer
_NUM_PIVOTS = 16
# The pivot pass sums each token's weight exp((u - max) / T) in [0, 1] rounded down to a
# multiple of 2^-20 in int32 lanes (at most 2^11 tokens a lane: vocabularies up to 2^21),
# and the row's total mass to 2^-40 in int64: integer sums do not depend on their order.
_MAX_VOCAB = 1 << 21


@triton.jit
def _filters(row, top_k_ptr, top_p_ptr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr):
    """(k, p, by_mass): k = 0 without top-k, p = 1 without top-p; ``by_mass`` when top-p
    bounds the kept tokens (top-p renormalises over what top-k keeps: with top-k only
    top-k's bound holds)."""
    k = tl.zeros([], tl.int32)
    p = tl.full([], 1.0, tl.float32)
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row)
    if HAS_TOP_P:
        p = tl.load(top_p_ptr + row).to(tl.float32)
    return k, p, (p < 1.0) & (k <= 0)


@triton.jit
def _row_from_slices(fstats_ptr, istats_ptr, row, num_slices, MAX_SLICES: tl.constexpr):
    """The row's max, smallest finite value, number of finite values and first index of the
    max (as ``_row_stats``), from its slices' (``_stats_kernel``)."""
    s = tl.arange(0, MAX_SLICES)
    ok = s < num_slices
    at = (row * num_slices + s) * 2
    best = tl.load(fstats_ptr + at, mask=ok, other=float("-inf"))
    low = tl.load(fstats_ptr + at + 1, mask=ok, other=float("inf"))
    first = tl.load(istats_ptr + at, mask=ok, other=2147483647)
    finite = tl.load(istats_ptr + at + 1, mask=ok, other=0)
    row_max, argmax = _argmax(best, first, 2147483647)  # slices in order: the first slice's index
    return row_max, tl.min(low, axis=0), tl.sum(finite, axis=0), argmax


@triton.jit
def _stats_kernel(logits_ptr, fstats_ptr, istats_ptr, vocab, stride_l, chunk, BLOCK: tl.constexpr):
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    lo = split * chunk
    num = tl.minimum(chunk, vocab - lo)
    row_max, row_min, finite, argmax = _row_stats(logits_ptr + row * stride_l + lo, num, BLOCK)
    at = (row * tl.num_programs(1) + split) * 2
    tl.store(fstats_ptr + at, row_max)
    tl.store(fstats_ptr + at + 1, row_min)
    tl.store(istats_ptr + at, lo + argmax)
    tl.store(istats_ptr + at + 1, finite)


@triton.jit
def _pivot_kernel(
    logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, fstats_ptr, istats_ptr, pivot_ptr, count_ptr, mass_ptr, total_ptr,
    vocab, stride_l, chunk,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, MAX_SLICES: tl.constexpr, BLOCK: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):  # fmt: skip
    """One slice's number of tokens above each pivot and, where top-p bounds, their mass and
    the slice's total mass (fixed point, see ``_MAX_VOCAB``)."""
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    num_slices = tl.num_programs(1)
    temp = tl.load(temp_ptr + row).to(tl.float32)
    if temp > 0:  # greedy rows need only the statistics
        row_max, row_min, _, _ = _row_from_slices(fstats_ptr, istats_ptr, row, num_slices, MAX_SLICES)
        _, _, by_mass = _filters(row, top_k_ptr, top_p_ptr, HAS_TOP_K, HAS_TOP_P)
        inv_temp = 1.0 / temp
        offs_p = tl.arange(0, NUM_PIVOTS)
        pivots = row_min + (row_max - row_min) * (offs_p.to(tl.float32) / (NUM_PIVOTS - 1))
        lo = split * chunk
        num = tl.minimum(chunk, vocab - lo)
        slice_ptr = logits_ptr + row * stride_l + lo
        count = tl.zeros([BLOCK, NUM_PIVOTS], tl.int32)
        mass = tl.zeros([BLOCK, NUM_PIVOTS], tl.int32)
        total = tl.zeros([BLOCK], tl.int64)
        for start in range(0, num, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            u = tl.load(slice_ptr + offs, mask=offs < num, other=float("-inf")).to(tl.float32)
            gt = u[:, None] > pivots[None, :]
            count += gt.to(tl.int32)
            if HAS_TOP_P:
                if by_mass:
                    w = tl.exp((u - row_max) * inv_temp)
                    mass += tl.where(gt, (w * 1048576.0).to(tl.int32)[:, None], 0)  # 2^20
                    total += (w * 1099511627776.0).to(tl.int64)  # 2^40
        at = (row * num_slices + split) * NUM_PIVOTS + offs_p
        tl.store(count_ptr + at, tl.sum(count, axis=0))
        tl.store(mass_ptr + at, tl.sum(mass.to(tl.int64), axis=0))
        tl.store(total_ptr + row * num_slices + split, tl.sum(total, axis=0))
        if split == 0:  # the gather compares with exactly these values
            tl.store(pivot_ptr + row * NUM_PIVOTS + offs_p, pivots)


@triton.jit
def _gather_kernel(
    logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, fstats_ptr, istats_ptr, pivot_ptr, count_ptr, mass_ptr, total_ptr,
    bound_ptr, low_ptr, val_ptr, idx_ptr, vocab, stride_l, chunk,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, MAX_SLICES: tl.constexpr, BLOCK: tl.constexpr,
    NUM_PIVOTS: tl.constexpr, CAPACITY: tl.constexpr,
):  # fmt: skip
    """The bound c (every kept token is > c) from the row's summed tables, and this slice's
    tokens above it copied in order to the buffer, after the earlier slices' tokens. The
    first slice stores (c, n, total) in ``bound_ptr``: n tokens are above c, and ``total`` is
    the row's mass (negative when top-k bounds: top-p then renormalises over what top-k keeps)."""
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    num_slices = tl.num_programs(1)
    temp = tl.load(temp_ptr + row).to(tl.float32)
    if temp > 0:
        s = tl.arange(0, MAX_SLICES)
        offs_p = tl.arange(0, NUM_PIVOTS)
        at = (row * num_slices + s)[:, None] * NUM_PIVOTS + offs_p[None, :]
        ok = (s < num_slices)[:, None]
        counts = tl.load(count_ptr + at, mask=ok, other=0)
        count = tl.sum(counts, axis=0)
        mass = tl.sum(tl.load(mass_ptr + at, mask=ok, other=0), axis=0)
        total = tl.sum(tl.load(total_ptr + row * num_slices + s, mask=s < num_slices, other=0), axis=0)
        finite = tl.load(istats_ptr + (row * num_slices + s) * 2 + 1, mask=s < num_slices, other=0)
        pivots = tl.load(pivot_ptr + row * NUM_PIVOTS + offs_p)
        k, p, by_mass = _filters(row, top_k_ptr, top_p_ptr, HAS_TOP_K, HAS_TOP_P)
        row_total = total.to(tl.float32) * 9.094947017729282e-13  # 2^-40
        # Pivots [0, j) bound the kept tokens. The masses are rounded down (by less than 2^-20
        # a token), so a pivot counts for top-p with a margin of 1/1024 over its cut: the
        # float search on the buffer could not keep a token below it either.
        dropped = mass.to(tl.float32) * 9.5367431640625e-07 >= p * row_total * (1.0 + 1.0 / 1024)  # 2^-20
        j = tl.where(by_mass, tl.sum(dropped.to(tl.int32), axis=0), 0)
        j = tl.where(k > 0, tl.sum((count >= k).to(tl.int32), axis=0), j)
        row_total = tl.where(k > 0, -1.0, row_total)
        c = tl.max(tl.where(offs_p == j - 1, pivots, float("-inf")), axis=0)
        # each slice's tokens above c: the count at pivot j - 1, or its finite values (c = -inf)
        above = tl.where(j > 0, tl.sum(tl.where(offs_p[None, :] == j - 1, counts, 0), axis=1), finite)
        n = tl.sum(above, axis=0)
        if split == 0:
            tl.store(bound_ptr + row * 3, c)
            tl.store(bound_ptr + row * 3 + 1, n.to(tl.float32))  # exact: n <= vocab < 2^24
            tl.store(bound_ptr + row * 3 + 2, row_total)
        if n <= CAPACITY:
            lo = split * chunk
            base = row * CAPACITY + tl.sum(tl.where(s < split, above, 0), axis=0)
            _, low = _gather_above(
                logits_ptr + row * stride_l + lo, tl.minimum(chunk, vocab - lo), lo, c, val_ptr + base, idx_ptr + base,
                BLOCK,
            )  # fmt: skip
            tl.store(low_ptr + row * num_slices + split, low)


@triton.jit
def _gather_above(ptr, num, first, c, val_ptr, idx_ptr, BLOCK: tl.constexpr):
    """Copy the tokens > c among ``num`` (values and indices from ``first``, in order) to the
    buffer; their number and minimum."""
    base = tl.zeros([], tl.int32)
    low = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, num, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        u = tl.load(ptr + offs, mask=offs < num, other=float("-inf")).to(tl.float32)
        sel = u > c
        count = tl.sum(sel.to(tl.int32), axis=0)
        if count > 0:
            pos = base + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(val_ptr + pos, u, mask=sel)
            tl.store(idx_ptr + pos, first + offs, mask=sel)
            low = tl.minimum(low, tl.where(sel, u, float("inf")))
            base += count
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
def _finish_kernel(
    logits_ptr, out_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, fstats_ptr, istats_ptr, bound_ptr,
    low_ptr, val_ptr, idx_ptr, vocab, stride_l, num_slices,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, MAX_SLICES: tl.constexpr,
    BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr, CAPACITY: tl.constexpr,
):  # fmt: skip
    """One row: the argmax if its temperature is 0, else the Gumbel race over its kept tokens,
    searched for on the buffer if the bound gathered one, else on the whole row."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l
    row_max, row_min, num_finite, token = _row_from_slices(fstats_ptr, istats_ptr, row, num_slices, MAX_SLICES)
    temp = tl.load(temp_ptr + row).to(tl.float32)
    if temp > 0:
        inv_temp = 1.0 / temp
        min_p = 0.0
        if HAS_MIN_P:
            min_p = tl.load(min_p_ptr + row).to(tl.float32)
        u_max = tl.div_rn(row_max, temp)
        seed = tl.load(seed_ptr + row)
        n = tl.load(bound_ptr + row * 3 + 1).to(tl.int32)
        if n <= CAPACITY:
            s = tl.arange(0, MAX_SLICES)
            low = tl.min(tl.load(low_ptr + row * num_slices + s, mask=s < num_slices, other=float("inf")), axis=0)
            total = tl.load(bound_ptr + row * 3 + 2)
            val_row, idx_row = val_ptr + row * CAPACITY, idx_ptr + row * CAPACITY
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
def _split_kernel(logits_ptr, temp_ptr, min_p_ptr, max_ptr, seed_ptr, score_ptr, index_ptr, vocab, stride_l, chunk,
                  HAS_MIN_P: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The best (score, first index) of one slice of one row: the argmax of ``x`` for a greedy
    row, of ``x / T - log(E)`` (``_draw``'s noise) over the tokens min-p keeps otherwise."""
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    row_ptr = logits_ptr + row * stride_l
    temp = tl.load(temp_ptr + row).to(tl.float32)
    seed = tl.load(seed_ptr + row)
    if HAS_MIN_P:  # (a greedy row ignores it)
        min_p = tl.load(min_p_ptr + row).to(tl.float32)
        u_max = tl.div_rn(tl.load(max_ptr + row), tl.where(temp > 0, temp, 1.0))
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
            u = tl.div_rn(x, temp)
            score = u - tl.log(-tl.log(unif))
            if HAS_MIN_P:  # as ``_draw``: prob >= min_p * max_prob
                score = tl.where(tl.exp(u - u_max) >= min_p, score, float("-inf"))
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


def split_sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    splits: int,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sample_tokens`` without top-k / top-p: one pass over each row (the Gumbel race needs
    no row maximum; min-p needs it, from ``amax``), split over ``splits`` programs (rounded
    down to a power of two; 1: a wider program per row, for batches that fill the GPU by their
    rows alone)."""
    num_rows, vocab = logits.shape
    splits = 1 << (splits.bit_length() - 1)
    row_max = logits.amax(dim=-1).float() if min_p is not None else temperatures  # max is exact in any order
    block, warps = (2048, 16) if splits == 1 else (1024, 4)
    chunk = triton.cdiv(triton.cdiv(vocab, splits), block) * block
    scores = torch.empty(num_rows, splits, dtype=torch.float32, device=logits.device)
    index = torch.empty(num_rows, splits, dtype=torch.int32, device=logits.device)
    _split_kernel[(num_rows, splits)](logits, temperatures, min_p if min_p is not None else temperatures, row_max,
                                      seeds, scores, index, vocab, logits.stride(0), chunk, HAS_MIN_P=min_p is not None,
                                      SPLITS=splits, BLOCK=block, num_warps=warps)  # fmt: skip
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    _best_split_kernel[(num_rows,)](scores, index, out, SPLITS=splits, num_warps=1)
    return out


def _splits(num_rows: int, vocab: int, device: torch.device) -> int:
    """Programs per row: about two per SM over the batch, each slice at least 4,096 tokens;
    1 (one program per row) once the rows alone fill the GPU."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = min(2 * sms // max(num_rows, 1), vocab // 4096, 64)
    return 1 << (want.bit_length() - 1) if want >= 2 else 1



def gather_candidates(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    splits: int,
    block: int | None = None,
) -> dict[str, torch.Tensor]:
    """Launches 1-3: each row's statistics, bound and buffer over ``splits`` slices. ``block``:
    the slice kernels' block (any power of two: the result does not depend on it)."""
    num_rows, vocab = logits.shape
    dev = logits.device
    chunk = triton.cdiv(triton.cdiv(vocab, splits), 16) * 16  # 16-aligned slices
    slices = triton.cdiv(vocab, chunk)
    block = block or min(1024, max(16, triton.next_power_of_2(chunk)))
    warps = 4 if slices > 1 else 16
    grid, max_slices = (num_rows, slices), max(2, triton.next_power_of_2(slices))
    fstats = torch.empty(num_rows, slices, 2, dtype=torch.float32, device=dev)
    istats = torch.empty(num_rows, slices, 2, dtype=torch.int32, device=dev)
    _stats_kernel[grid](logits, fstats, istats, vocab, logits.stride(0), chunk, BLOCK=block, num_warps=warps)
    ws = dict(fstats=fstats, istats=istats, slices=slices, max_slices=max_slices)
    ws["values"] = torch.empty(num_rows, _CAPACITY, dtype=torch.float32, device=dev)
    ws["indices"] = torch.empty(num_rows, _CAPACITY, dtype=torch.int32, device=dev)
    ws["bound"] = torch.empty(num_rows, 3, dtype=torch.float32, device=dev)  # c, n, total
    ws["low"] = torch.empty(num_rows, slices, dtype=torch.float32, device=dev)
    pivots = torch.empty(num_rows, _NUM_PIVOTS, dtype=torch.float32, device=dev)
    count = torch.empty(num_rows, slices, _NUM_PIVOTS, dtype=torch.int32, device=dev)
    mass = torch.empty(num_rows, slices, _NUM_PIVOTS, dtype=torch.int64, device=dev)
    total = torch.empty(num_rows, slices, dtype=torch.int64, device=dev)
    filters = (temperatures, top_k if top_k is not None else temperatures, top_p if top_p is not None else temperatures)
    flags = dict(HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None, MAX_SLICES=max_slices,
                 NUM_PIVOTS=_NUM_PIVOTS)  # fmt: skip
    # [block, 16] counts and masses: 16 warps keep them in registers
    _pivot_kernel[grid](logits, *filters, fstats, istats, pivots, count, mass, total, vocab, logits.stride(0), chunk,
                        BLOCK=block, num_warps=16, **flags)  # fmt: skip
    _gather_kernel[grid](logits, *filters, fstats, istats, pivots, count, mass, total, ws["bound"], ws["low"],
                         ws["values"], ws["indices"], vocab, logits.stride(0), chunk, BLOCK=block, CAPACITY=_CAPACITY,
                         num_warps=warps, **flags)  # fmt: skip
    return ws


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,
    splits: int | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """See ``atom.ops.sampling.sample_tokens``: no sort; rows without top-k / top-p in one pass
    (``split_sample``), the others in four launches. ``splits`` (slices per row,
    default ``_splits``) and ``block`` (the filter slice
    kernels' block) change the speed, never the tokens."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    num_rows, vocab = logits.shape
    if vocab > _MAX_VOCAB:
        raise ValueError(f"sample_tokens: a vocabulary of {vocab} tokens is over the kernel's {_MAX_VOCAB}")
    splits = splits or _splits(num_rows, vocab, logits.device)
    if num_rows > 0 and top_k is None and top_p is None:
        return split_sample(logits, temperatures, seeds, splits, min_p)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    ws = gather_candidates(logits, temperatures, top_k, top_p, splits, block)
    _finish_kernel[(num_rows,)](
        logits,
        out,
        temperatures,
        top_k if top_k is not None else temperatures,
        top_p if top_p is not None else temperatures,
        min_p if min_p is not None else temperatures,
        seeds,
        ws["fstats"],
        ws["istats"],
        ws["bound"],
        ws["low"],
        ws["values"],
        ws["indices"],
        vocab,
        logits.stride(0),
        ws["slices"],
        HAS_TOP_K=top_k is not None,
        HAS_TOP_P=top_p is not None,
        HAS_MIN_P=min_p is not None,
        MAX_SLICES=ws["max_slices"],
        BLOCK=min(1024, max(16, triton.next_power_of_2(vocab))),
        NUM_PIVOTS=_NUM_PIVOTS,
        CAPACITY=_CAPACITY,
        num_warps=16,
    )
    return out
