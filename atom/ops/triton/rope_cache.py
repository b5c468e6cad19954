"""Rotary embedding, KV-cache write, and the fused per-head q/k RMSNorm + RoPE + cache
write that every attention layer runs before paged attention.

Cache layout is ``[num_blocks, num_kv_heads, block_size, head_dim]`` (see
``atom.ops.reference``); a token's slot is ``block_id * block_size + offset`` and a negative
slot means "do not store". An fp8 cache stores ``clamp(x / scale)`` (see
``atom.ops.reference.to_cache_dtype``); the scale is read from a device pointer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def to_cache(val, cache_ptr, scale):
    """``val`` in ``cache_ptr``'s element type as the cache stores it: for fp8, ``val / scale``
    saturated (``atom.ops.reference.to_cache_dtype``)."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        val = tl.clamp(tl.math.div_rn(val.to(tl.float32), scale), -448.0, 448.0)  # IEEE-rounded, as the reference
    return val.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_heads(
    cache_ptr,
    slot,
    heads,
    offs_d,
    mask,
    val,
    stride_cb,
    stride_ch,
    stride_ct,
    BLOCK_SIZE: tl.constexpr,
    scale=1.0,
):
    """Write ``val`` ([heads, d]) to the cache slot ``slot`` (an fp8 cache: ``val / scale``,
    saturated)."""
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    ptrs = cache_ptr + block * stride_cb + offset * stride_ct + heads[:, None] * stride_ch + offs_d[None, :]
    tl.store(ptrs, to_cache(val, cache_ptr, scale), mask=mask)


@triton.jit
def _norm_rope_heads(
    x_ptr,
    out_ptr,
    w_ptr,
    tok,
    heads,
    num_heads,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    cos,
    sin,
    eps,
    HAS_NORM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Optional per-head RMSNorm, then neox RoPE, of ``heads`` of token ``tok``; stores the
    result to ``out_ptr`` and returns it as two halves (rounded to the output dtype)."""
    offs = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (offs[None, :] < HALF)
    x_ptrs = x_ptr + tok * stride_xt + heads[:, None] * stride_xh + offs[None, :]
    x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if HAS_NORM:
        ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        rstd = tl.rsqrt(ms + eps)[:, None]
        w1 = tl.load(w_ptr + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
        # Same roundings as the reference: normalised value, then the weighted value.
        x1 = (w1 * (x1 * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)).to(dtype).to(tl.float32)
    o1 = (x1 * cos - x2 * sin).to(dtype)
    o2 = (x2 * cos + x1 * sin).to(dtype)
    o_ptrs = out_ptr + tok * stride_ot + heads[:, None] * stride_oh + offs[None, :]
    tl.store(o_ptrs, o1, mask=mask)
    tl.store(o_ptrs + HALF, o2, mask=mask)
    return o1, o2


# per-step values (sequence count, block-table width, metadata slice offsets) are not
# specialized on: each new combination would compile a variant in the middle of serving
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _qk_norm_rope_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_out_ptr,
    q_w_ptr,
    k_w_ptr,
    pos_ptr,
    cos_sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_q_heads,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cos_sin,
    stride_cb,
    stride_ch,
    stride_ct,
    eps,
    HAS_NORM: tl.constexpr,
    HAS_CACHE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # Program (token, head block): the first head blocks cover q, the rest cover k and v.
    tok = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_H)

    offs = tl.arange(0, BLOCK_HALF)
    pos = tl.load(pos_ptr + tok)
    cs_ptrs = cos_sin_ptr + pos * stride_cos_sin + offs
    # The reference casts cos/sin to the activation dtype before rotating.
    cos = tl.load(cs_ptrs, mask=offs < HALF, other=0.0)
    sin = tl.load(cs_ptrs + HALF, mask=offs < HALF, other=0.0)
    cos = cos.to(k_out_ptr.dtype.element_ty).to(tl.float32)[None, :]
    sin = sin.to(k_out_ptr.dtype.element_ty).to(tl.float32)[None, :]

    if head_block < num_q_blocks:
        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        _norm_rope_heads(
            q_ptr, q_out_ptr, q_w_ptr, tok, heads, num_q_heads,
            stride_qt, stride_qh, stride_qot, stride_qoh,
            cos, sin, eps, HAS_NORM, HALF, BLOCK_HALF,
        )  # fmt: skip
    else:
        heads = (head_block - num_q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        k1, k2 = _norm_rope_heads(
            k_ptr, k_out_ptr, k_w_ptr, tok, heads, num_kv_heads,
            stride_kt, stride_kh, stride_kot, stride_koh,
            cos, sin, eps, HAS_NORM, HALF, BLOCK_HALF,
        )  # fmt: skip
        if HAS_CACHE:
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            if slot >= 0:
                k_scale, v_scale = 1.0, 1.0
                if HAS_SCALE:
                    k_scale, v_scale = tl.load(k_scale_ptr), tl.load(v_scale_ptr)
                mask = (heads[:, None] < num_kv_heads) & (offs[None, :] < HALF)
                _store_heads(k_cache_ptr, slot, heads, offs, mask, k1, stride_cb, stride_ch, stride_ct, BLOCK_SIZE,
                             k_scale)  # fmt: skip
                _store_heads(k_cache_ptr + HALF, slot, heads, offs, mask, k2, stride_cb, stride_ch, stride_ct,
                             BLOCK_SIZE, k_scale)  # fmt: skip
                v_ptrs = v_ptr + tok * stride_vt + heads[:, None] * stride_vh + offs[None, :]
                v1 = tl.load(v_ptrs, mask=mask, other=0.0)
                v2 = tl.load(v_ptrs + HALF, mask=mask, other=0.0)
                _store_heads(v_cache_ptr, slot, heads, offs, mask, v1, stride_cb, stride_ch, stride_ct, BLOCK_SIZE,
                             v_scale)  # fmt: skip
                _store_heads(v_cache_ptr + HALF, slot, heads, offs, mask, v2, stride_cb, stride_ch, stride_ct,
                             BLOCK_SIZE, v_scale)  # fmt: skip


def _heads_view(t: torch.Tensor) -> torch.Tensor:
    """[T, H, D] with unit stride along D (views such as slices of a fused qkv are kept)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    has_norm = q_norm_weight is not None
    has_cache = k_cache is not None and k_cache.numel() > 0
    q, k = _heads_view(q), _heads_view(k)
    v = _heads_view(v) if has_cache else k
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_dtype = torch.promote_types(q.dtype, q_norm_weight.dtype) if has_norm else q.dtype
    k_dtype = torch.promote_types(k.dtype, k_norm_weight.dtype) if has_norm else k.dtype
    q_out = torch.empty(q.shape, dtype=q_dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k_dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    if not has_cache:
        k_cache = v_cache = k_out  # unused: HAS_CACHE is False
        slot_mapping = positions
    half = head_dim // 2
    block_h = min(triton.next_power_of_2(max(num_q_heads, num_kv_heads)), 8)
    grid = (num_tokens, triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_kv_heads, block_h))
    _qk_norm_rope_store_kernel[grid](
        q,
        k,
        v,
        q_out,
        k_out,
        q_norm_weight if has_norm else q,
        k_norm_weight if has_norm else k,
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if k_scale is not None else q,
        v_scale if v_scale is not None else q,
        num_q_heads,
        num_kv_heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        eps,
        HAS_NORM=has_norm,
        HAS_CACHE=has_cache,
        HAS_SCALE=k_scale is not None,
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_H=block_h,
        BLOCK_SIZE=k_cache.shape[2] if has_cache else 1,
        num_warps=4 if block_h * head_dim >= 1024 else 1,
    )
    return q_out, k_out


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return qk_norm_rope_store(q, k, k, None, None, 0.0, positions, cos_sin_cache, None, None, None)


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _store_kv_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_ct,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        k = tl.load(k_ptr + tok * stride_kt + heads[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + tok * stride_vt + heads[:, None] * stride_vh + offs_d[None, :], mask=mask)
        k_scale, v_scale = 1.0, 1.0
        if HAS_SCALE:
            k_scale, v_scale = tl.load(k_scale_ptr), tl.load(v_scale_ptr)
        _store_heads(k_cache_ptr, slot, heads, offs_d, mask, k, stride_cb, stride_ch, stride_ct, BLOCK_SIZE, k_scale)
        _store_heads(v_cache_ptr, slot, heads, offs_d, mask, v, stride_cb, stride_ch, stride_ct, BLOCK_SIZE, v_scale)


def store_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    k, v = _heads_view(k), _heads_view(v)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_h = min(triton.next_power_of_2(num_kv_heads), 8)
    _store_kv_cache_kernel[(num_tokens, triton.cdiv(num_kv_heads, block_h))](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if k_scale is not None else k,
        v_scale if v_scale is not None else k,
        num_kv_heads,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_H=block_h,
        BLOCK_SIZE=k_cache.shape[2],
        HAS_SCALE=k_scale is not None,
        num_warps=4 if block_h * head_dim >= 1024 else 1,
    )
