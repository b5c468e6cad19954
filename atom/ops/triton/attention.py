"""Paged attention over a mixed batch of prefill chunks and decode rows.

One kernel serves every row kind. A program owns a tile of ``BLOCK_M`` query rows that
share one KV head: ``BLOCK_Q`` consecutive query tokens of one sequence times the
``GROUP`` query heads that read that KV head (GQA packing). Decode rows are simply
sequences with one query token, so a decode program's rows are its GQA group and the
K/V it streams is read once for all of them.

The grid's first axis enumerates query tiles without any host-side metadata: sequence
``i`` owns tiles ``cu_seqlens_q[i] // BLOCK_Q + i`` onwards, which leaves room for its
``cdiv(q_len, BLOCK_Q)`` tiles; a program finds its sequence by binary search over
``cu_seqlens_q`` and exits if its tile is past the sequence's end. Tile sizes suit either
decode or prefill, so a mixed batch whose decode rows come first is run as two launches.
Launches whose chunks fill 128-row tiles go to the prefill kernel of
``atom.ops.triton.prefill_attention`` (same tiling, tuned for the causal compute-bound case).

Split-K (flash decoding): with few sequences there are too few programs to fill the GPU,
so the key range of each tile is cut into ``num_splits`` segments handled by separate
programs that write unnormalised partial results; a second kernel merges them. Large decode
batches of uneven contexts may split too, into segments of a minimum length, so that a long
sequence's keys spread over several programs while short ones stay whole (``_num_splits``).

An fp8 cache (``float8_e4m3fn``) is read as is and multiplied by its per-layer scales:
the K scale folds into the softmax scale and the V scale into the output.

A head_dim that is not a power of two (Triton's blocks are) runs in tiles padded to the next
one, its padding columns masked (read as zeros, never stored); a power of two compiles exactly
as before (``with_columns`` is then the row mask alone).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from atom.ops.triton import prefill_attention_gluon as gluon
from atom.ops.triton.attention_merge import merge_splits, split_partials, with_columns
from atom.ops.triton.prefill_attention import _find_seq, _num_sms, descriptor_ready, prefill_attention

# Hopper: prefill chunks that fill the Gluon kernel's 128-row query tiles run there (docs/kernels.md);
# ATOM_GLUON_PREFILL=0 keeps them on this package's Triton kernel
GLUON_PREFILL = os.environ.get("ATOM_GLUON_PREFILL", "1") == "1"


@functools.cache
def _gluon_prefill(device: torch.device) -> bool:
    """Whether prefill on ``device`` may take the Gluon kernel (decided once: every layer asks every step)."""
    return GLUON_PREFILL and gluon.available(device)


# per-step values (sequence count, block-table width, metadata slice offsets) are not
# specialized on: each new combination would compile a variant in the middle of serving
@triton.jit(
    do_not_specialize=["num_seqs", "num_splits", "min_split_tiles", "stride_bt"],
    do_not_specialize_on_alignment=["cu_seqlens_q_ptr", "seq_lens_ptr", "block_tables_ptr"],
)
def _paged_attention_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    num_seqs,
    num_splits,
    min_split_tiles,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ch,
    stride_ct,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Token indices are relative to the first sequence's, so a launch can cover a slice
    # of the batch (q_ptr and out_ptr then point at that slice's first token).
    q_base = tl.load(cu_seqlens_q_ptr)
    seq = _find_seq(cu_seqlens_q_ptr, q_base, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq) - q_base
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_base - q_start
    first_q = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    v_scale = 1.0
    if HAS_SCALE:
        qk_scale *= tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)

    # Row m is query token first_q + m // GROUP_PAD, query head kv_head * GROUP + m % GROUP_PAD.
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = first_q + offs_m // GROUP_PAD
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_ok = (q_idx < q_len) & (offs_m % GROUP_PAD < GROUP)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row_mask = with_columns(row_ok[:, None], offs_d[None, :], HEAD_DIM, HEAD_DIM_PAD)
    tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask,
        other=0.0,
    )
    # Causal: row at absolute position context_len + q_idx sees keys up to and including it.
    q_pos = context_len + q_idx
    kv_end = tl.minimum(seq_len, context_len + first_q + BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    # at least ``min_split_tiles`` a split: a short sequence leaves its last splits empty
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), min_split_tiles)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64) * stride_ch
    for t in range(tile_lo, tile_hi):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        page = tl.load(table + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_off = page * stride_cb + kv_head_off + (offs_n % PAGE_SIZE) * stride_ct
        k_mask = with_columns(n_ok[None, :], offs_d[:, None], HEAD_DIM, HEAD_DIM_PAD)
        k = tl.load(k_cache_ptr + kv_off[None, :] + offs_d[:, None], mask=k_mask, other=0.0)
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row may see no key of this tile yet (a split that starts past its causal
        # limit); keep it at -inf without producing NaNs.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_mask = with_columns(n_ok[:, None], offs_d[None, :], HEAD_DIM, HEAD_DIM_PAD)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=v_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        # Partial results [token, head, split, ...]; the merge kernel normalises. A split past
        # the keys stores only its -inf max, and the merge reads no output row for it (decode
        # graphs are captured for the longest context: at short ones most splits are empty).
        row = (tok * tl.num_programs(1) * GROUP + head) * num_splits + split
        tl.store(part_max_ptr + row, m_i, mask=row_ok)
        tl.store(part_sum_ptr + row, l_i, mask=row_ok)
        if tile_lo < tile_hi:
            tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc * v_scale, mask=row_mask)
    else:
        out = acc * v_scale / l_i[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )


# Decode batches that fill the GPU unsplit still wait on their longest sequences (one program a sequence
# and KV head; the throughput workload's contexts run 100-2,000 keys): up to BALANCE_SPLITS splits of at
# least SPLIT_MIN_KEYS keys each, so a long sequence's keys spread over several programs and a short one's
# stay whole. H200, session 31 (`kernel_sweep.py decode_varlen`, 128-256 sequences of 100-2,000 keys, 4 or
# 8 KV heads): 2 of >= 512 keys 1.5-7% faster than unsplit; 4-16 splits, or shorter ones, slower.
BALANCE_SPLITS = 2
SPLIT_MIN_KEYS = 512


def _num_splits(
    q: torch.Tensor, num_seqs: int, num_kv_heads: int, max_seqlen_q: int, max_seqlen_k: int
) -> tuple[int, int]:
    """Key-range splits for a decode-only batch, and the fewest keys a split takes. Batches whose
    (sequence, KV head) programs would not fill the GPU: the largest power of two that keeps the
    programs within four per SM, each split at least 32 keys (measured on an H100 at Qwen3-8B heads,
    docs/performance.md, kernel section: batch 1 wants 64 splits even at 2k context, batch 8 wants 8,
    batch 32 wants 2, 3 was 15% slower, batch 64 none). Larger ones: ``BALANCE_SPLITS``."""
    if max_seqlen_q > 1 or not q.is_cuda:
        return 1, 0
    fill = 4 * _num_sms(q.device.index or 0) // (num_seqs * num_kv_heads)
    splits = min(fill, max_seqlen_k // 32, 64)
    if splits >= 2:
        return 1 << (splits.bit_length() - 1), 0
    balance = min(BALANCE_SPLITS, max_seqlen_k // SPLIT_MIN_KEYS)
    return (1 << (balance.bit_length() - 1), SPLIT_MIN_KEYS) if balance >= 2 else (1, 0)


def _config(
    head_dim: int, group_pad: int, max_seqlen_q: int, elem_bytes: int, long_range: bool = True, fp8_cache: bool = False
) -> dict:
    """Tile shapes. ``block_m`` query rows (query tokens x padded GQA group) per program:
    decode packs only the group (at least 16 rows, tl.dot's minimum); batches with long
    enough prefill chunks use large tiles. Wide rows (head_dim 256, or float32) get fewer
    keys per step and float32 no multi-stage pipelining, to fit registers and shared memory.
    ``long_range``: each decode program walks a whole sequence or a balance split (not the
    short ranges of a small batch split to fill the GPU); ``fp8_cache``: one-byte keys and
    values. Picked by tests/gpu/kernel_sweep.py on an H200."""
    row_bytes = head_dim * elem_bytes
    stages = 1 if elem_bytes == 4 else 2
    if max_seqlen_q * group_pad >= 128:
        if row_bytes > 256:
            return dict(block_m=max(64, group_pad), block_n=32, num_warps=4, num_stages=stages)
        return dict(block_m=max(128, group_pad), block_n=128, num_warps=8, num_stages=stages)
    if row_bytes > 256:
        return dict(block_m=max(16, group_pad), block_n=32, num_warps=4, num_stages=stages)
    # decode: 128 keys a step over long ranges where a key read feeds enough work: 8+ query heads a KV
    # head (H200, session 32, `kernel_sweep.py decode decode_varlen`: 4-5% faster over 128-256 uneven
    # sequences at 32 / 4 heads, 7-8% slower at 32 / 8; 4-12% slower in batch 1-8's fill splits), or an
    # fp8 cache unsplit (half the bytes of 64 bf16 keys: 21% faster at batch 64 x 2k context on an H100,
    # docs/fp8.md; its fill splits 2-9% slower; balance splits are off for it)
    wide = long_range and (group_pad >= 8 or fp8_cache)
    return dict(block_m=max(16, group_pad), block_n=128 if wide else 64, num_warps=4, num_stages=stages)


def _attend(
    q, out, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_seqlen_q, max_seqlen_k, num_splits,
    k=None, v=None, kv_scales=(None, None),
):  # fmt: skip
    """One launch over a contiguous slice of the batch (q, out and the metadata sliced alike)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    min_keys = 0
    if num_splits is None:
        if max_seqlen_k is None and max_seqlen_q == 1:
            max_seqlen_k = int(seq_lens.max())
        num_splits, min_keys = _num_splits(q, num_seqs, num_kv_heads, max_seqlen_q, max_seqlen_k or 0)
        if min_keys and k_cache.element_size() == 1:  # an fp8 cache's unsplit 128-key steps (_config) instead
            num_splits, min_keys = 1, 0

    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    log2e = 1.4426950408889634
    if num_splits == 1 and max_seqlen_q * group_pad >= 128:
        if (k is not None and max_seqlen_q >= gluon.BLOCK_M and _gluon_prefill(q.device)
                and gluon.supported(q, k, v) and gluon.cache_supported(q, k_cache, v_cache)):  # fmt: skip
            gluon.prefill_attention_gluon(q, k, v, out, cu_seqlens_q, scale * log2e,
                                          cache=(k_cache, v_cache, seq_lens, block_tables), max_seqlen_q=max_seqlen_q,
                                          max_seqlen_k=max_seqlen_k)  # fmt: skip
            return
        prefill_attention(q, out, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale * log2e, k=k, v=v,
                          kv_scales=kv_scales, max_seqlen_k=max_seqlen_k)  # fmt: skip
        return
    long_range = num_splits == 1 or min_keys > 0
    cfg = _config(triton.next_power_of_2(head_dim), group_pad, max_seqlen_q, q.element_size(), long_range,
                  k_cache.element_size() == 1)  # fmt: skip
    block_q = cfg["block_m"] // group_pad
    num_tiles = num_tokens // block_q + num_seqs
    split = num_splits > 1
    if split:
        part_out, part_max, part_sum = split_partials(num_tokens, num_q_heads, num_splits, head_dim, q.device)
    else:
        part_out = part_max = part_sum = out  # unused: SPLIT is False
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        out,
        part_out,
        part_max,
        part_sum,
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        kv_scales[0] if kv_scales[0] is not None else q,
        kv_scales[1] if kv_scales[1] is not None else q,
        scale * log2e,
        num_seqs,
        num_splits,
        triton.cdiv(min_keys, cfg["block_n"]),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_N=cfg["block_n"],
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        PAGE_SIZE=page_size,
        SPLIT=split,
        DOT_PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32",
        HAS_SCALE=kv_scales[0] is not None,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if split:
        merge_splits(out, part_out, part_max, part_sum)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    num_decode_tokens: int = 0,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See ``atom.ops.reference.paged_attention``.

    ``max_seqlen_q``/``max_seqlen_k`` pick the tile shape and the split-K factor; when left
    out they are read from the device (a host sync). ``num_decode_tokens``: the batch's
    first sequences are that many decode rows (``AttentionMetadata`` places them first);
    in a mixed batch they then get a launch with decode tiles instead of sharing the
    prefill's large tiles, which would compute mostly padding for them. ``num_splits``
    overrides the split-K heuristic (1 = no split). ``k``/``v`` (optional; the attention layer
    passes them): the batch's new keys and values, [tokens, kv_heads, head_dim], the same
    values the cache holds for them; prefill tiles then read the chunk's own keys through
    tensor descriptors (bulk tensor copies) instead of gathering them from the cache; not
    with an fp8 cache, whose values differ from the unquantised ``k``/``v``.
    ``k_scale``/``v_scale``: an fp8 cache's scales (float32, one element each). ``out``: where
    to write the result (shaped like ``q``, unit stride along head_dim); returned.
    """
    out = torch.empty_like(q) if out is None else out
    if q.shape[0] == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    n = num_decode_tokens
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    kv = (k, v) if k is not None and v is not None and not fp8 and descriptor_ready(k, v) else (None, None)
    scales = (k_scale, v_scale) if fp8 and k_scale is not None else (None, None)
    if max_seqlen_q > 1 and 0 < n < seq_lens.shape[0]:
        decode = (cu_seqlens_q[: n + 1], seq_lens[:n], block_tables[:n])
        prefill = (cu_seqlens_q[n:], seq_lens[n:], block_tables[n:])
        _attend(q[:n], out[:n], k_cache, v_cache, *decode, scale, 1, max_seqlen_k, num_splits, kv_scales=scales)
        kv = tuple(t if t is None else t[n:] for t in kv)
        # the batch's max_seqlen_k may be a decode row's: unknown for the chunks (no split-K)
        _attend(q[n:], out[n:], k_cache, v_cache, *prefill, scale, max_seqlen_q, None, num_splits, *kv,
                kv_scales=scales)  # fmt: skip
    else:
        metadata = (cu_seqlens_q, seq_lens, block_tables)
        _attend(q, out, k_cache, v_cache, *metadata, scale, max_seqlen_q, max_seqlen_k, num_splits, *kv,
                kv_scales=scales)  # fmt: skip
    return out
