"""Causal paged attention for batches whose rows are prefill chunks (FlashAttention-2 style).

Tiles and metadata follow ``atom.ops.triton.attention`` (``BLOCK_Q`` query tokens of one
sequence times the ``GROUP`` query heads of one KV head per program, sequences found by
binary search over ``cu_seqlens_q``), with what makes the prefill case fast on Hopper:

- The key loop is split in two. Key tiles that every query row of the program sees are
  processed with no mask at all; only the tiles on the causal diagonal pay for the mask.
  Every row sees the first key of the first processed tile, so the running max is finite
  after it and the softmax needs no guard against ``-inf - -inf``.
- The softmax scale is folded into the exponent (``exp2(s * scale - m)``, one FMA per
  score) with ``log2(e)`` folded into ``scale`` by the caller.
- Programs are launched heaviest first: the last tiles of a sequence see the most keys,
  so the grid runs tiles in reverse, with the KV head as the fastest-varying axis, which
  keeps the tail of the launch short.
- Two programs per SM (128 rows over 8 warps capped at 128 registers, or 64 rows over 4
  warps): the softmax between a program's two MMAs stalls its tensor cores, and the
  other program's MMAs fill that time (``prefill_config`` has the measured table).
- K and V are gathered through the block table (software-pipelined loads), except that
  when the caller also passes the chunk's own K/V packed, the tiles made only of chunk
  keys come through tensor descriptors (the bulk tensor copy engine).
- Short chunks over a long cached prefix leave too few 128-row query tiles to fill the SMs,
  so the key range is cut into ``splits`` segments run by separate programs (split-K, merged
  by ``atom.ops.triton.attention_merge``); segments are counted from the diagonal back, so
  the last one always holds a fully visible tile before the masked ones.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from atom.ops.triton.attention_merge import merge_splits, split_partials, with_columns


@triton.jit
def _find_seq(cu_seqlens_q_ptr, q_base, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest sequence index ``i`` with ``(cu_seqlens_q[i] - q_base) // BLOCK_Q + i <= tile``."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = (tl.load(cu_seqlens_q_ptr + mid) - q_base) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_kv(k_cache_ptr, v_cache_ptr, k_desc, v_desc, table, kv_head_off, t, kv_end, desc_row, desc_col, stride_cb,
             stride_ct, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
             PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, FROM_DESC: tl.constexpr):  # fmt: skip
    """Key tile ``t`` as [BLOCK_N, HEAD_DIM] K and V: from the packed current chunk through
    tensor descriptors (bulk tensor copies), or gathered from the paged cache."""
    if FROM_DESC:
        row = desc_row + t * BLOCK_N
        return k_desc.load([row, desc_col]), v_desc.load([row, desc_col])
    offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    if MASKED:
        n_ok = offs_n < kv_end
        page = tl.load(table + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_off = page * stride_cb + kv_head_off + (offs_n % PAGE_SIZE) * stride_ct
        mask = with_columns(n_ok[:, None], offs_d[None, :], HEAD_DIM, HEAD_DIM_PAD)
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=mask, other=0.0)
        return k, v
    page = tl.load(table + offs_n // PAGE_SIZE).to(tl.int64)
    kv_off = page * stride_cb + kv_head_off + (offs_n % PAGE_SIZE) * stride_ct
    if HEAD_DIM_PAD == HEAD_DIM:
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :])
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :])
    else:
        cols = (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=cols, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=cols, other=0.0)
    return k, v


@triton.jit
def _attend_tile(q, k, v, t, m_i, l_i, acc, qk_scale, q_pos, kv_end, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):  # fmt: skip
    """One key tile of the online softmax; ``MASKED`` applies the causal and length mask."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
    if MASKED:
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n < kv_end)[None, :]
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# per-step values (sequence count, block-table width, metadata slice offsets) are not
# specialized on: each new combination would compile a variant in the middle of serving
@triton.jit(
    do_not_specialize=["num_seqs", "num_splits", "stride_bt"],
    do_not_specialize_on_alignment=["cu_seqlens_q_ptr", "seq_lens_ptr", "block_tables_ptr"],
)
def _prefill_attention_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_desc, v_desc,
    cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr, qk_scale, num_seqs, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ch, stride_ct, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PACKED_KV: tl.constexpr, SPLIT: tl.constexpr, HAS_SCALE: tl.constexpr,
):  # fmt: skip
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    kv_head = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # heaviest (last) tiles first

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
    if HAS_SCALE:  # fp8 cache: the K scale folds into the softmax scale, the V scale into the output
        qk_scale *= tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = first_q + offs_m // GROUP_PAD
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_ok = (q_idx < q_len) & (offs_m % GROUP_PAD < GROUP)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row_mask = with_columns(row_ok[:, None], offs_d[None, :], HEAD_DIM, HEAD_DIM_PAD)
    tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask, other=0.0)  # fmt: skip

    # The tile's first query sits at position first_pos and sees keys 0..first_pos, so key
    # tiles below full_hi are visible to every row; the rest (up to kv_end) need the mask.
    first_pos = context_len + first_q
    q_pos = context_len + q_idx
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
    full_hi = (first_pos + 1) // BLOCK_N
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    lo = 0
    hi = full_hi
    diag_lo = full_hi
    if SPLIT:  # segment `split` of the visible tiles, counted back from the diagonal
        split = tl.program_id(2)
        per = tl.cdiv(full_hi, num_splits)
        hi = tl.maximum(full_hi - (num_splits - 1 - split) * per, 0)
        lo = tl.maximum(hi - per, 0)
        diag_lo = tl.where(split == num_splits - 1, full_hi, num_tiles)
    # With the chunk's own K/V passed packed, full tiles made only of chunk keys are read
    # from there (row desc_row + t * BLOCK_N of the packed tensor); the rest from the cache.
    paged_hi = tl.minimum(full_hi, tl.cdiv(context_len, BLOCK_N)) if PACKED_KV else full_hi
    desc_row = q_start - context_len
    desc_col = kv_head * HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64) * stride_ch
    for t in range(lo, tl.minimum(hi, paged_hi)):
        k, v = _load_kv(k_cache_ptr, v_cache_ptr, k_desc, v_desc, table, kv_head_off, t, kv_end, desc_row, desc_col,
                        stride_cb, stride_ct, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, False, False)  # fmt: skip
        m_i, l_i, acc = _attend_tile(q, k, v, t, m_i, l_i, acc, qk_scale, q_pos, kv_end, BLOCK_N, False,
                                     DOT_PRECISION)  # fmt: skip
    if PACKED_KV:
        for t in range(tl.maximum(lo, paged_hi), hi):
            k, v = _load_kv(k_cache_ptr, v_cache_ptr, k_desc, v_desc, table, kv_head_off, t, kv_end, desc_row,
                            desc_col, stride_cb, stride_ct, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, False,
                            True)  # fmt: skip
            m_i, l_i, acc = _attend_tile(q, k, v, t, m_i, l_i, acc, qk_scale, q_pos, kv_end, BLOCK_N, False,
                                         DOT_PRECISION)  # fmt: skip
    for t in range(diag_lo, num_tiles):
        k, v = _load_kv(k_cache_ptr, v_cache_ptr, k_desc, v_desc, table, kv_head_off, t, kv_end, desc_row, desc_col,
                        stride_cb, stride_ct, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, True, False)  # fmt: skip
        m_i, l_i, acc = _attend_tile(q, k, v, t, m_i, l_i, acc, qk_scale, q_pos, kv_end, BLOCK_N, True,
                                     DOT_PRECISION)  # fmt: skip
    if SPLIT:  # unnormalised partials [token, head, split, ...] for the merge kernel
        row = (tok * (tl.num_programs(0) * GROUP) + head) * num_splits + tl.program_id(2)
        tl.store(part_max_ptr + row, m_i, mask=row_ok)
        tl.store(part_sum_ptr + row, l_i, mask=row_ok)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc * v_scale, mask=row_mask)
    else:
        out = acc * v_scale / l_i[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask)  # fmt: skip


def prefill_config(head_dim: int, group_pad: int, elem_bytes: int, programs_per_sm: float = 2.0,
                   packed: bool = False, max_seqlen_k: int = 0) -> dict:  # fmt: skip
    """Tile shape of the prefill kernel. ``programs_per_sm``: (query tiles x KV heads) / SMs
    at 128 query rows per tile; ``packed``: the chunk's own K/V come through descriptors;
    ``max_seqlen_k``: the longest sequence (0: unknown).
    Measured on an H100 at head_dim 128 in 16 bits (docs/performance.md, kernel section):
    the kernel is bound by the softmax between its two MMAs, which a second program on the
    SM overlaps, so 128 rows over 8 warps capped at 128 registers (two programs per SM, a
    few spills) beat every one-program config; short chunks over a long cached prefix leave
    too few 128-row tiles, so their key range is split in two (q=512 after 4096 cached: 5%
    faster than 64-row tiles, which the shorter ones keep). Wide rows (head_dim 256, float32)
    get narrow key tiles to fit registers and shared memory."""
    row_bytes = head_dim * elem_bytes
    if row_bytes > 256:
        return dict(block_m=max(64, group_pad), block_n=32, num_warps=4, num_stages=1 if elem_bytes == 4 else 2)
    if row_bytes < 256:
        return dict(block_m=max(128, group_pad), block_n=128, num_warps=8, num_stages=2)
    capped = dict(block_m=128, block_n=64, num_warps=8, num_stages=2 if packed else 3, maxnreg=128)
    if group_pad <= 128 and programs_per_sm >= 1.5:
        return capped
    if group_pad <= 128 and programs_per_sm >= 0.75 and max_seqlen_k >= 4096:
        return {**capped, "splits": 2}
    return dict(block_m=max(64, group_pad), block_n=64, num_warps=4, num_stages=3)


def descriptor_ready(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether packed K/V [tokens, kv_heads, head_dim] can back a tensor descriptor: rows of
    contiguous heads, 16-byte aligned base and row stride (the bulk copy engine's rule); a head_dim
    that is not a power of two is left to ``prefill_attention``, which then reads the cache."""
    return all(t.stride(2) == 1 and t.stride(1) == t.shape[2] and (t.stride(0) * t.element_size()) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in (k, v))  # fmt: skip


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count if torch.cuda.is_available() else 1


def prefill_attention(q, out, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, config=None,
                      k=None, v=None, kv_scales=(None, None), max_seqlen_k=0):  # fmt: skip
    """Launch over a contiguous slice of the batch (q, out and the metadata sliced alike);
    ``scale`` already includes log2(e). ``k``/``v``: optionally the slice's own new keys and
    values, packed [tokens, kv_heads, head_dim] (last dim contiguous, rows 16-byte aligned),
    the same values the cache holds for them. ``kv_scales``: an fp8 cache's (k_scale, v_scale)
    tensors. ``config``: ``prefill_config``'s keys (``splits``: key-range segments per query
    tile, default 1); ``max_seqlen_k`` (0: unknown) lets the default split long key ranges.
    Returns the compiled kernel (for its resource report)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = triton.next_power_of_2(head_dim)
    if head_dim != head_dim_pad:  # a descriptor's block is a power of two: read the chunk from the cache
        k = v = None
    programs_per_sm = (num_tokens * group_pad / 128 + num_seqs) * num_kv_heads / _num_sms(q.device.index or 0)
    cfg = config or prefill_config(head_dim_pad, group_pad, q.element_size(), programs_per_sm, k is not None,
                                   max_seqlen_k or 0)  # fmt: skip
    block_q = cfg["block_m"] // group_pad
    splits = cfg.get("splits", 1)
    grid = (num_kv_heads, num_tokens // block_q + num_seqs, splits)
    k_desc = v_desc = None
    if k is not None:
        block = [cfg["block_n"], head_dim]
        k_desc, v_desc = (TensorDescriptor(t, [num_tokens, num_kv_heads * head_dim], [t.stride(0), 1], block)
                          for t in (k, v))  # fmt: skip
    parts = split_partials(num_tokens, num_q_heads, splits, head_dim, q.device) if splits > 1 else (out,) * 3
    kernel = _prefill_attention_kernel[grid](
        out, *parts, q, k_cache, v_cache, k_desc, v_desc, cu_seqlens_q, seq_lens, block_tables,
        q if kv_scales[0] is None else kv_scales[0], q if kv_scales[1] is None else kv_scales[1], scale, num_seqs,
        splits, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=cfg["block_n"], HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, PAGE_SIZE=page_size, DOT_PRECISION="tf32x3" if q.element_size() == 4 else "tf32",
        PACKED_KV=k is not None,
        SPLIT=splits > 1, HAS_SCALE=kv_scales[0] is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        maxnreg=cfg.get("maxnreg"),
    )  # fmt: skip
    if splits > 1:
        merge_splits(out, *parts)
    return kernel
