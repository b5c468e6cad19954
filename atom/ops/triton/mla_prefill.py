"""MLA prompt attention: causal FlashAttention-style over expanded keys and values, all of
a step's sequences in one launch. A sequence's queries are the last rows of its keys: the same
rows for a whole prompt, fewer after earlier rows (a cached prefix or chunk, read back and
expanded by the caller).

The keys are never concatenated: a score is ``q_nope . k_nope + q_pe . k_pe`` as two dots,
where ``k_nope`` is the head's slice of ``kv_b_proj``'s output and ``k_pe`` the token's
rotated RoPE key, one row shared by every head (MLA's decoupled RoPE). Values are the other
slice of the same ``kv_b_proj`` rows. One program is a (sequence, query tile, head); it
walks the key tiles up to its last query row's position, with the online softmax in float32 (exp2 with
``log2(e)`` folded into the scale). Head dims need not be powers of two (they are padded and
masked). ``atom.ops.mla.mla_prefill_attention`` is the reference.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from atom.ops.triton.mla import _has_wgmma


@triton.jit(do_not_specialize=["max_seqlen"])
def _mla_prefill_kernel(
    q_ptr, kv_ptr, kpe_ptr, out_ptr, cu_q_ptr, cu_k_ptr, scale_log2, max_seqlen,
    stride_qt, stride_qh, stride_kvt, stride_kvh, stride_pt, stride_ot, stride_oh,
    NOPE: tl.constexpr, ROPE: tl.constexpr, V: tl.constexpr,
    P_NOPE: tl.constexpr, P_ROPE: tl.constexpr, P_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    seq, head = tl.program_id(0), tl.program_id(2)
    start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - start
    k_start = tl.load(cu_k_ptr + seq)
    k_len = tl.load(cu_k_ptr + seq + 1) - k_start
    m0 = tl.program_id(1) * BLOCK_M
    if m0 >= q_len:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < q_len
    q_pos = k_len - q_len + offs_m  # the queries are the sequence's last rows
    rows = (start + offs_m).to(tl.int64)
    dn, dr, dv = tl.arange(0, P_NOPE), tl.arange(0, P_ROPE), tl.arange(0, P_V)
    q_row = q_ptr + rows[:, None] * stride_qt + head * stride_qh
    q_nope = tl.load(q_row + dn[None, :], mask=m_ok[:, None] & (dn[None, :] < NOPE), other=0.0)
    q_pe = tl.load(q_row + NOPE + dr[None, :], mask=m_ok[:, None] & (dr[None, :] < ROPE), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, P_V], tl.float32)
    hi = tl.minimum(k_len - q_len + m0 + BLOCK_M, k_len)  # causal: no key after the tile's last query
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        k_rows = (k_start + offs_n).to(tl.int64)
        kv_col = kv_ptr + k_rows[None, :] * stride_kvt + head * stride_kvh
        k_nope = tl.load(kv_col + dn[:, None], mask=n_ok[None, :] & (dn[:, None] < NOPE), other=0.0)
        k_pe = tl.load(kpe_ptr + k_rows[None, :] * stride_pt + dr[:, None], mask=n_ok[None, :] & (dr[:, None] < ROPE),
                       other=0.0)  # fmt: skip
        s = tl.dot(q_nope, k_nope, input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, k_pe, s, input_precision=DOT_PRECISION) * scale_log2
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(kv_ptr + k_rows[:, None] * stride_kvt + head * stride_kvh + NOPE + dv[None, :],
                    mask=n_ok[:, None] & (dv[None, :] < V), other=0.0)  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_ot + head * stride_oh + dv[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (dv[None, :] < V))


def _prefill_config(wide: bool, hopper: bool) -> dict:
    """Tile config (``tests/gpu/kernel_sweep.py mla_prefill`` times others); float32 tiles
    (``wide``) take half the rows, to stay within shared memory. On Hopper 16-bit tiles of 128
    query rows, 8 warps and 3 stages (~170 KB of shared memory): a 2048-token chunk after 6144
    earlier rows 1.13x (16 heads) and 1.17x (128 heads) faster than 64 x 64 / 4 warps / 2 stages,
    whole 1k prompts the same (H200, session 22)."""
    if wide:
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2)
    if hopper:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)


def _pad(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))  # tl.dot takes 16+ wide operands


def mla_prefill_attention(
    q: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, scale: float, v_head_dim: int,
) -> torch.Tensor:  # fmt: skip
    num_tokens, num_heads, qk_dim = q.shape
    out = q.new_empty(num_tokens, num_heads, v_head_dim)
    if num_tokens == 0:
        return out
    nope = kv.shape[-1] - v_head_dim
    rope = qk_dim - nope
    wide = q.element_size() == 4
    cfg = _prefill_config(wide, _has_wgmma(q.device))
    grid = (cu_seqlens_q.shape[0] - 1, triton.cdiv(max_seqlen_q, cfg["BLOCK_M"]), num_heads)
    _mla_prefill_kernel[grid](
        q, kv, k_pe, out, cu_seqlens_q, cu_seqlens_k, scale * math.log2(math.e), max_seqlen_q,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), k_pe.stride(0), out.stride(0), out.stride(1),
        NOPE=nope, ROPE=rope, V=v_head_dim, P_NOPE=_pad(nope), P_ROPE=_pad(rope), P_V=_pad(v_head_dim),
        DOT_PRECISION="tf32x3" if wide else "tf32", **cfg,
    )  # fmt: skip
    return out
