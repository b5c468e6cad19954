"""Multi-head latent attention kernels: the RoPE + latent cache write, and decode attention
over the paged latent cache (weight absorption: every head reads the same latent rows).

Cache layout: ``kv_cache [num_blocks, block_size, kv_lora_rank + rope_dim]`` (see
``atom.ops.mla``, whose functions of the same names are the references). An fp8 cache holds
the row divided by the layer's ``k_scale``: the store quantises, decode loads e4m3 rows,
widens them to the query's dtype, and folds the scale into the softmax scale and the output.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from atom.ops.triton import mla_gluon
from atom.ops.triton.mla_merge import merge_splits
from atom.ops.triton.rope_cache import to_cache

# 16-bit caches decode through the Gluon kernels on Hopper (mla_gluon.py: 2.2-2.9x this file's kernel at
# DeepSeek-V3's 128 heads, 1.4-2.7x at 16, docs/kernels.md), fp8 ones at 16 and 32 heads;
# ATOM_MLA_GLUON_DECODE=0 keeps them here
GLUON_DECODE = os.environ.get("ATOM_MLA_GLUON_DECODE", "1") == "1"


@functools.cache
def _gluon_decode(device: torch.device) -> bool:
    """Whether decode on ``device`` may take the Gluon kernel (decided once: every layer asks every step)."""
    return GLUON_DECODE and mla_gluon.available(device)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


@triton.jit
def _rope_pair(x_ptr, offs, mask, cos, sin, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The two halves of the rotated rope dims at ``x_ptr`` (pairs when ``INTERLEAVED``)."""
    if INTERLEAVED:
        x1 = tl.load(x_ptr + 2 * offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + 2 * offs + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _mla_rope_store_kernel(
    q_ptr, kv_c_ptr, k_pe_ptr, pos_ptr, cos_sin_ptr, cache_ptr, slot_ptr, k_scale_ptr, norm_w_ptr, norm_eps,
    q_out_ptr, k_out_ptr,
    num_heads, stride_qt, stride_qh, stride_qot, stride_qoh, stride_ct, stride_kt, stride_kot,
    stride_cos_sin, stride_cb, stride_cs,
    NOPE: tl.constexpr, OUT_NOPE: tl.constexpr, RANK: tl.constexpr, HALF: tl.constexpr, BLOCK_NOPE: tl.constexpr,
    BLOCK_RANK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_CACHE: tl.constexpr, HAS_SCALE: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    # Program (token, head block); the extra last head block handles the shared key.
    tok = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    offs = tl.arange(0, BLOCK_HALF)
    pos = tl.load(pos_ptr + tok)
    cs = cos_sin_ptr + pos * stride_cos_sin + offs
    dtype = q_out_ptr.dtype.element_ty
    # the reference casts cos/sin to the activation dtype before rotating
    cos = tl.load(cs, mask=offs < HALF, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(cs + HALF, mask=offs < HALF, other=0.0).to(dtype).to(tl.float32)
    if head_block < tl.cdiv(num_heads, BLOCK_H):
        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads[:, None] < num_heads
        offs_n = tl.arange(0, BLOCK_NOPE)
        src = q_ptr + tok * stride_qt + heads[:, None] * stride_qh
        dst = q_out_ptr + tok * stride_qot + heads[:, None] * stride_qoh
        if OUT_NOPE > 0:  # the output rows carry the nope columns too (else only the rope ones)
            nope_mask = hmask & (offs_n[None, :] < NOPE)
            tl.store(dst + offs_n[None, :], tl.load(src + offs_n[None, :], mask=nope_mask), mask=nope_mask)
        rmask = hmask & (offs[None, :] < HALF)
        o1, o2 = _rope_pair(src + NOPE, offs[None, :], rmask, cos[None, :], sin[None, :], HALF, INTERLEAVED)
        tl.store(dst + OUT_NOPE + offs[None, :], o1.to(dtype), mask=rmask)
        tl.store(dst + OUT_NOPE + HALF + offs[None, :], o2.to(dtype), mask=rmask)
    else:
        kmask = offs < HALF
        k1, k2 = _rope_pair(k_pe_ptr + tok * stride_kt, offs, kmask, cos, sin, HALF, INTERLEAVED)
        k1, k2 = k1.to(dtype), k2.to(dtype)
        tl.store(k_out_ptr + tok * stride_kot + offs, k1, mask=kmask)
        tl.store(k_out_ptr + tok * stride_kot + HALF + offs, k2, mask=kmask)
        if HAS_CACHE:
            slot = tl.load(slot_ptr + tok)
            if slot >= 0:
                entry = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
                offs_r = tl.arange(0, BLOCK_RANK)
                c = tl.load(kv_c_ptr + tok * stride_ct + offs_r, mask=offs_r < RANK, other=0.0)
                if NORM:  # rms_norm's rounding: normed in float32, to the dtype, times the weight
                    cf = c.to(tl.float32)
                    h = (cf * tl.rsqrt(tl.sum(cf * cf, axis=0) / RANK + norm_eps)).to(c.dtype).to(tl.float32)
                    c = (tl.load(norm_w_ptr + offs_r, mask=offs_r < RANK, other=0.0).to(tl.float32) * h).to(c.dtype)
                k_scale = 1.0
                if HAS_SCALE:
                    k_scale = tl.load(k_scale_ptr)
                tl.store(entry + offs_r, to_cache(c, cache_ptr, k_scale), mask=offs_r < RANK)
                tl.store(entry + RANK + offs, to_cache(k1, cache_ptr, k_scale), mask=kmask)
                tl.store(entry + RANK + HALF + offs, to_cache(k2, cache_ptr, k_scale), mask=kmask)


def mla_rope_store(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
    interleaved: bool,
    k_scale: torch.Tensor | None = None,
    q_pe_out: torch.Tensor | None = None,
    kv_norm: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_pe_out``: a [T, H, rope] view that takes the query's rotated rope columns instead of
    a new [T, H, nope + rope] tensor (the nope columns are then not copied: the absorbed decode
    query replaces them); returned in the query's place. ``kv_norm``: (weight, eps) of the
    RMSNorm ``kv_c`` takes before the cache write (as ``rms_norm`` rounds it; a launch fewer
    than the norm's own kernel)."""
    num_tokens, num_heads, head_dim = q.shape
    rope_dim, rank = k_pe.shape[-1], kv_c.shape[-1]
    q_out = torch.empty_like(q) if q_pe_out is None else q_pe_out
    k_out = torch.empty(k_pe.shape, dtype=k_pe.dtype, device=k_pe.device)
    if num_tokens == 0:
        return q_out, k_out
    has_cache = kv_cache is not None and kv_cache.numel() > 0
    cache = kv_cache if has_cache else k_out
    block_size = kv_cache.shape[1] if has_cache else 1
    has_scale = has_cache and kv_cache.dtype == torch.float8_e4m3fn and k_scale is not None
    block_h = min(16, triton.next_power_of_2(num_heads))
    grid = (num_tokens, triton.cdiv(num_heads, block_h) + 1)
    norm_weight, norm_eps = kv_norm if kv_norm is not None else (positions, 0.0)
    _mla_rope_store_kernel[grid](
        q, kv_c, k_pe, positions, cos_sin_cache, cache, slot_mapping if has_cache else positions,
        k_scale if has_scale else positions, norm_weight, norm_eps, q_out, k_out,
        num_heads, q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1), kv_c.stride(0), k_pe.stride(0),
        k_out.stride(0), cos_sin_cache.stride(0), cache.stride(0), cache.stride(1) if has_cache else 0,
        NOPE=head_dim - rope_dim, OUT_NOPE=0 if q_pe_out is not None else head_dim - rope_dim,
        RANK=rank, HALF=rope_dim // 2, BLOCK_NOPE=_pow2(head_dim - rope_dim, 1),
        BLOCK_RANK=_pow2(rank, 1), BLOCK_HALF=_pow2(rope_dim // 2, 1), BLOCK_H=block_h, BLOCK_SIZE=block_size,
        INTERLEAVED=interleaved, HAS_CACHE=has_cache, HAS_SCALE=has_scale, NORM=kv_norm is not None,
    )  # fmt: skip
    return q_out, k_out


# per-step values (split count, block-table width, metadata slices) are not specialized on: each
# new combination would compile a variant in the middle of serving (as in attention.py)
@triton.jit(
    do_not_specialize=["num_splits", "stride_tb"],
    do_not_specialize_on_alignment=["seq_lens_ptr", "tables_ptr"],
)
def _mla_decode_kernel(
    q_ptr, cache_ptr, seq_lens_ptr, tables_ptr, k_scale_ptr, out_ptr, part_out_ptr, part_ml_ptr, scale, num_heads,
    num_splits,
    stride_qb, stride_qh, stride_cb, stride_cs, stride_tb, stride_ob, stride_oh,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_RANK: tl.constexpr, BLOCK_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SCALE: tl.constexpr, HALVES: tl.constexpr,
):  # fmt: skip
    # Program (head block, sequence, split): online softmax over the split's latent rows,
    # loaded once for all the block's heads (the point of absorption). Head blocks vary
    # fastest, so the programs reading the same rows run side by side and share them in L2
    # (sequence first, the head blocks of a large batch ran in separate waves, each reading the
    # rows from memory again). With SPLIT the partial results go to part_* for mla_merge.
    # HALVES: the latent columns as two halves (two tiles, two accumulators, two dots sharing P)
    # rather than one of each: at 64 heads the compiler then fits the loop in the registers.
    COLS: tl.constexpr = BLOCK_RANK // 2 if HALVES else BLOCK_RANK
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    seq = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    offs_r = tl.arange(0, COLS)
    offs_r2 = COLS + offs_r  # the second half (HALVES)
    offs_p = tl.arange(0, BLOCK_ROPE)
    # heads past the last read its query again (their results are not stored): no head mask for the
    # compiler to keep in registers across the loop until the store
    q_rows = q_ptr + seq * stride_qb + tl.minimum(heads, num_heads - 1)[:, None] * stride_qh
    q_lat = tl.load(q_rows + offs_r[None, :], mask=offs_r[None, :] < RANK, other=0.0)
    if HALVES:
        q_lat2 = tl.load(q_rows + offs_r2[None, :], mask=offs_r2[None, :] < RANK, other=0.0)
    q_pe = tl.load(q_rows + RANK + offs_p[None, :], mask=offs_p[None, :] < ROPE, other=0.0)
    seq_len = tl.load(seq_lens_ptr + seq)
    if HAS_SCALE:  # fp8 cache: the scale of both halves of the row folds into the softmax scale
        scale *= tl.load(k_scale_ptr)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, COLS], tl.float32)
    if HALVES:
        acc2 = tl.zeros([BLOCK_H, COLS], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        nmask = offs_n < hi
        block = tl.load(tables_ptr + seq * stride_tb + offs_n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        rows = cache_ptr + block[:, None] * stride_cb + (offs_n % BLOCK_SIZE)[:, None] * stride_cs
        lat = tl.load(rows + offs_r[None, :], mask=nmask[:, None] & (offs_r[None, :] < RANK), other=0.0)
        k_pe = tl.load(rows + RANK + offs_p[None, :], mask=nmask[:, None] & (offs_p[None, :] < ROPE), other=0.0)
        lat, k_pe = lat.to(q_lat.dtype), k_pe.to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        if HALVES:
            lat2 = tl.load(rows + offs_r2[None, :], mask=nmask[:, None] & (offs_r2[None, :] < RANK), other=0.0)
            lat2 = lat2.to(q_lat.dtype)
            s += tl.dot(q_lat2, tl.trans(lat2), input_precision=DOT_PRECISION)
        s = tl.where(nmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        p = p.to(lat.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, lat, input_precision=DOT_PRECISION)
        if HALVES:
            acc2 = acc2 * alpha[:, None] + tl.dot(p, lat2, input_precision=DOT_PRECISION)
        m = m_new
    if HAS_SCALE:  # ... and into the values (the latents)
        acc *= tl.load(k_scale_ptr)
        if HALVES:
            acc2 *= tl.load(k_scale_ptr)
    _mla_decode_store(acc, m, denom, offs_r, seq, heads, split, out_ptr, part_out_ptr, part_ml_ptr, num_heads,
                      num_splits, stride_ob, stride_oh, RANK, BLOCK_RANK, SPLIT, True)  # fmt: skip
    if HALVES:
        _mla_decode_store(acc2, m, denom, offs_r2, seq, heads, split, out_ptr, part_out_ptr, part_ml_ptr,
                          num_heads, num_splits, stride_ob, stride_oh, RANK, BLOCK_RANK, SPLIT, False)  # fmt: skip


@triton.jit
def _mla_decode_store(
    acc, m, denom, offs_r, seq, heads, split, out_ptr, part_out_ptr, part_ml_ptr, num_heads, num_splits,
    stride_ob, stride_oh, RANK: tl.constexpr, BLOCK_RANK: tl.constexpr, SPLIT: tl.constexpr, STORE_ML: tl.constexpr,
):  # fmt: skip
    """A program's result for the latent columns ``offs_r``: normalised, or with SPLIT the partial
    sums (and, once per program, ``STORE_ML``, the running max and denominator) for the merge."""
    hmask = heads < num_heads
    omask = hmask[:, None] & (offs_r[None, :] < RANK)
    if SPLIT:
        row = (seq * num_heads + heads) * num_splits + split  # [BLOCK_H]
        tl.store(part_out_ptr + row[:, None] * BLOCK_RANK + offs_r[None, :], acc, mask=omask)
        if STORE_ML:
            tl.store(part_ml_ptr + 2 * row, m, mask=hmask)
            tl.store(part_ml_ptr + 2 * row + 1, denom, mask=hmask)
    else:
        o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_r[None, :]
        tl.store(o_ptrs, (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=omask)


def _num_splits(device: torch.device, num_programs: int) -> int:
    """Context splits when the (sequence, head block) programs would not fill the GPU: the
    largest power of two keeping them within four per SM, at most 32 (batch-1 decode of a
    16-head model gets 32 programs per row instead of one)."""
    if device.type != "cuda":
        return 1
    from atom.ops.triton.prefill_attention import _num_sms

    fill = min(4 * _num_sms(device.index or 0) // num_programs, 32)
    return 1 if fill < 2 else 1 << (fill.bit_length() - 1)


def _decode_config(num_seqs: int, num_heads: int, block_rank: int, tile_bytes: int, wgmma: bool) -> dict:
    """Tile config of ``_mla_decode_kernel``: ``BLOCK_H`` heads per program share each tile of
    ``BLOCK_N`` latent rows it loads (tests/gpu/kernel_sweep.py mla times alternatives). With
    64 heads or more (DeepSeek-V3 and its -tp 2 shard) and 8 rows or more, 64 heads per program
    on Hopper's wgmma with the latent columns as two halves: 1.1x the 16-head tile at 8 rows,
    1.5x at 32 and 2.1x at 128 (bf16 and fp8 caches, 4k context, H100, docs/performance.md);
    at one row it is 7% slower, and with 16-32 heads the 16-head tile wins. Its shared memory
    (about 220 KB with 16-bit tiles) needs a Hopper-class GPU (``wgmma``) and queries and cache of at
    most two bytes an element (``tile_bytes``)."""
    if wgmma and num_heads >= 64 and num_seqs >= 8 and block_rank >= 256 and tile_bytes <= 2:
        return dict(BLOCK_H=64, BLOCK_N=64, HALVES=True, num_warps=8, num_stages=2)
    return dict(BLOCK_H=16, BLOCK_N=32 if block_rank >= 256 else 64, HALVES=False, num_warps=4, num_stages=3)


@functools.cache
def _has_wgmma(device: torch.device) -> bool:
    """Hopper (sm_90): wgmma and ~227 KB of shared memory a block. Not sm_100 (untuned) nor
    sm_120 (about 100 KB: the 64-head tile would not fit)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    k_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``num_splits``: context segments handled by separate programs and merged (chosen from
    the device's SM count when None; one on the CPU). ``k_scale``: an fp8 cache's scale."""
    num_seqs, num_heads, dim = q.shape
    if num_seqs and _gluon_decode(q.device) and mla_gluon.supported(q, kv_cache, kv_lora_rank):
        return mla_gluon.mla_decode_gluon(q, kv_cache, seq_lens, block_tables, scale, num_splits, k_scale=k_scale)
    out = torch.empty(num_seqs, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if not fp8:
        q = q.to(kv_cache.dtype)
    has_scale = fp8 and k_scale is not None
    block_rank = _pow2(kv_lora_rank)
    tile_bytes = max(q.element_size(), kv_cache.element_size())  # an fp8 cache keeps q's dtype
    config = _decode_config(num_seqs, num_heads, block_rank, tile_bytes, _has_wgmma(q.device))
    head_blocks = triton.cdiv(num_heads, config["BLOCK_H"])
    splits = num_splits or _num_splits(q.device, num_seqs * head_blocks)
    part_out = part_ml = out
    if splits > 1:
        part_out = torch.empty(num_seqs, num_heads, splits, block_rank, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_seqs, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    _mla_decode_kernel[(head_blocks, num_seqs, splits)](
        q, kv_cache, seq_lens, block_tables, k_scale if has_scale else seq_lens, out, part_out, part_ml, scale,
        num_heads, splits,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        RANK=kv_lora_rank, ROPE=dim - kv_lora_rank, BLOCK_RANK=block_rank, BLOCK_ROPE=_pow2(dim - kv_lora_rank),
        BLOCK_SIZE=kv_cache.shape[1], DOT_PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32",
        SPLIT=splits > 1, HAS_SCALE=has_scale, **config,
    )  # fmt: skip
    if splits > 1:
        merge_splits(out, part_out, part_ml)
    return out
