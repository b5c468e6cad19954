"""MLA decode attention for Hopper written in Gluon, FlashMLA style.

Scope: a 16-bit latent cache ``[blocks, page, 576]`` (kv_lora_rank 512 + rope 64, DeepSeek-V2/V3's
dims) with pages of at least 8 rows, a 16-bit query whose head count is a multiple or a divisor of 64
(DeepSeek-V3: 128, 64 at ``-tp 2``, 16 at ``-tp 8``; V2-Lite and Moonlight: 16), sm_90. Everything else
stays on ``atom.ops.triton.mla``. 16 and 32 heads run ``mla_gluon_narrow.py``'s kernel (the heads as
the MMA's N) unless ``config`` says ``narrow: False``; this file's kernel takes the rest.

Each program owns 64 heads of one sequence over one context split, in 64-key tiles (with fewer heads,
the 64 MMA rows past them hold the next sequences' queries or zeros, computed and never stored). The
64 x 512 float32 accumulator does not fit one warpgroup's registers, so two math warpgroups hold half
of its columns each, and they run FlashMLA's "seesaw" schedule over pairs of tiles (t0 in key buffer
0, t1 in key buffer 1):

- **WG0** (the default partition): S0 = Q K0^T and its online softmax against the running max; the
  max and the factor for the old sums go to WG1 through shared memory; O_L = O_L * f0 + P0 V0_L; then,
  with WG1's max over t1, P0 in its units to shared memory for WG1 and O_L += P1 V1_L with WG1's P1.
- **WG1**: S1 = Q K1^T and its softmax against WG0's max; P1 to shared memory (in the query's rope
  chunk: both warpgroups hold those 64 query columns in registers), O_R = O_R * f0 f1 + P1 V1_R
  + P0 V0_R.
- a one-warp **loader** issuing bulk tensor copies (TMA): the query once (nine 64-column chunks),
  then each key tile in two halves (chunks 0-3, the left values; 4-8, the right values and the rope
  columns), each refilled as soon as its one last reader releases it.

Each warpgroup runs its MMAs while the other computes its softmax, so the tensor cores stay busy,
and the MMA work is even (one QK^T and two half PVs each per pair). The row sums are kept per
warpgroup in the same units and added at the end. Shared memory: Q 72 KiB, two key buffers of
72 KiB, P0 8 KiB (about 226 KiB: one program per SM). Programs run head blocks fastest, so the
blocks of one sequence read its latent rows from L2 the second time.

The latent rows of the last tile past the sequence (the rest of its last page, or a page clamped to
the last one) are read but masked out of the softmax: P is zero there, and the cache holds finite
values (atom and vLLM allocate it zeroed).
"""

from __future__ import annotations

import torch

from atom.ops.triton import mla_gluon_narrow, prefill_attention_gluon
from atom.ops.triton.mla_gluon_base import (
    BLOCK_N,
    CHUNKS,
    COLS,
    FP8,
    HAVE_GLUON,
    LOG2E,
    RANK,
    ROPE,
    available,  # noqa: F401 - mla.py asks this module
    operands,
)
from atom.ops.triton.mla_merge import merge_splits

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from atom.ops.triton.mla_gluon_base import split_range

HEADS = 64  # heads per program (one warpgroup's MMA rows)


def supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """Shapes, dtypes and layouts the kernels handle: a cache of q's 16-bit dtype, or an fp8 one at the
    narrow kernel's head counts."""
    _, num_heads, dim = q.shape
    _, page, cache_dim = kv_cache.shape
    cache_ok = kv_cache.dtype == q.dtype or (kv_cache.dtype == FP8 and mla_gluon_narrow.supported(num_heads))
    return (q.dtype in (torch.bfloat16, torch.float16) and cache_ok and kv_lora_rank == RANK
            and dim == RANK + ROPE and cache_dim == dim and (num_heads % HEADS == 0 or HEADS % num_heads == 0)
            and page >= 8
            and page & (page - 1) == 0 and kv_cache.stride(2) == 1 and kv_cache.stride(1) == dim
            and kv_cache.stride(0) == page * dim and kv_cache.data_ptr() % 16 == 0)  # fmt: skip


if HAVE_GLUON:
    _HEADS = gl.constexpr(HEADS)  # kernels read module constants only as constexpr
    _BLOCK_N = gl.constexpr(BLOCK_N)
    _COLS = gl.constexpr(COLS)
    _CHUNKS = gl.constexpr(CHUNKS)
    _RANK = gl.constexpr(RANK)
    # the math warpgroups' layouts: S (64 heads x 64 keys) and their half of O (64 x 256) as wgmma
    # accumulators, P and Q's rope chunk as register operands, and the row vectors of both
    _S = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    _O = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 4 * COLS, 16])
    _S_LAYOUT = gl.constexpr(_S)
    _O_LAYOUT = gl.constexpr(_O)
    _P_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_O, k_width=2))
    _Q_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_S, k_width=2))
    _ROW_LAYOUT = gl.constexpr(gl.SliceLayout(1, _S))
    _O_ROW_LAYOUT = gl.constexpr(gl.SliceLayout(1, _O))

    @gluon.jit
    def _store(acc, col0: gl.constexpr, seq, head0, split, num_heads, num_splits, out_ptr, part_out_ptr,
               stride_ob, stride_oh, l_i, SPLIT: gl.constexpr, layout: gl.constexpr):  # fmt: skip
        """Half of the program's result (256 columns from ``col0``): normalised, or with SPLIT the
        unnormalised sums."""
        heads = head0 + gl.arange(0, _HEADS, layout=gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, 4 * _COLS, layout=gl.SliceLayout(0, layout))
        mask = (heads < num_heads)[:, None]  # rows past a head count below 64 are padding
        if SPLIT:
            row = (seq * num_heads + heads) * num_splits + split
            gl.store(part_out_ptr + row[:, None] * _RANK + cols[None, :], acc, mask=mask)
        else:
            offs = seq * stride_ob + heads[:, None] * stride_oh + cols[None, :]
            gl.store(out_ptr + offs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _half(k_smem, stage, half: gl.constexpr):
        """Latent columns ``256 * half`` to ``256 * half + 255`` of the tile in ``stage`` as one [64, 256]
        operand (its four 64-column chunks are laid out as a 256-column 128-byte-swizzled tile)."""
        first = k_smem.index(stage * _CHUNKS + 4 * half)  # reinterpreted from its first chunk on
        return first._reinterpret(k_smem.dtype, [_BLOCK_N, 4 * _COLS], k_smem.layout)

    @gluon.jit
    def _load_half(c_desc, k_smem, bar, tables_ptr, stride_tb, seq, first_key, last_box, buf,
                   HALF: gl.constexpr, PAGE: gl.constexpr, ROWS: gl.constexpr):  # fmt: skip
        """Half ``HALF`` of the 64-key tile from ``first_key`` into key buffer ``buf``: chunks 0-3 (the
        left values) or 4-8 (the right values and the rope columns), signalled on ``bar``."""
        C0: gl.constexpr = 4 * HALF
        NC: gl.constexpr = 4 + HALF
        mbarrier.expect(bar, NC * (_BLOCK_N // ROWS) * c_desc.block_type.nbytes)
        for i in gl.static_range(_BLOCK_N // ROWS):
            key = gl.minimum(first_key + i * ROWS, last_box)  # past the sequence: its last box (masked)
            page = gl.load(tables_ptr + seq * stride_tb + key // PAGE)
            row = page * PAGE + key % PAGE
            for j in gl.static_range(NC):
                tma.async_copy_global_to_shared(c_desc, [row, (C0 + j) * _COLS], bar,
                                                k_smem.index(buf * _CHUNKS + C0 + j).slice(i * ROWS, ROWS))

    @gluon.jit
    def _refill(c_desc, k_smem, k_ready, kv_empty, I: gl.constexpr, phase, tables_ptr, stride_tb, seq, first_key,
                last_box, PAGE: gl.constexpr, ROWS: gl.constexpr):  # fmt: skip
        """Half ``I % 2`` of key buffer ``I // 2`` once its last reader has released it (``kv_empty``
        ``I``), then the tile's half from ``first_key`` into it (``k_ready`` ``I``)."""
        mbarrier.wait(kv_empty.index(I), phase)
        _load_half(c_desc, k_smem, k_ready.index(I), tables_ptr, stride_tb, seq, first_key, last_box, I // 2, I % 2,
                   PAGE, ROWS)  # fmt: skip

    @gluon.jit
    def _loader(q_desc, c_desc, q_smem, k_smem, q_ready, k_ready, kv_empty, tables_ptr, stride_tb, q_row, seq,
                lo, n_tiles, last_key, PAGE: gl.constexpr, ROWS: gl.constexpr):  # fmt: skip
        """Tile ``t`` goes to key buffer ``t % 2`` in two halves (barriers ``2 * buffer + half``); from
        the second pair on, each half is refilled once its one last reader has released it, in the
        order the pair's schedule releases them."""
        mbarrier.expect(q_ready, _CHUNKS * q_desc.block_type.nbytes)
        for j in gl.static_range(_CHUNKS):
            tma.async_copy_global_to_shared(q_desc, [q_row, j * _COLS], q_ready, q_smem.index(j))
        last_box = (last_key // ROWS) * ROWS
        for t in range(gl.minimum(n_tiles, 2)):
            key = lo + t * _BLOCK_N
            _load_half(c_desc, k_smem, k_ready.index(2 * t), tables_ptr, stride_tb, seq, key, last_box, t, 0, PAGE,
                       ROWS)  # fmt: skip
            _load_half(c_desc, k_smem, k_ready.index(2 * t + 1), tables_ptr, stride_tb, seq, key, last_box, t, 1,
                       PAGE, ROWS)  # fmt: skip
        for p in range(1, gl.cdiv(n_tiles, 2)):
            phase = (p - 1) & 1
            key0 = lo + 2 * p * _BLOCK_N
            has1 = 2 * p + 1 < n_tiles
            _refill(c_desc, k_smem, k_ready, kv_empty, 0, phase, tables_ptr, stride_tb, seq, key0, last_box, PAGE, ROWS)
            if has1:
                _refill(c_desc, k_smem, k_ready, kv_empty, 3, phase, tables_ptr, stride_tb, seq, key0 + _BLOCK_N,
                        last_box, PAGE, ROWS)  # fmt: skip
            _refill(c_desc, k_smem, k_ready, kv_empty, 1, phase, tables_ptr, stride_tb, seq, key0, last_box, PAGE, ROWS)
            if has1:
                _refill(c_desc, k_smem, k_ready, kv_empty, 2, phase, tables_ptr, stride_tb, seq, key0 + _BLOCK_N,
                        last_box, PAGE, ROWS)  # fmt: skip

    @gluon.jit
    def _qk(q_smem, q_rope, k_smem, buf, z, s, FIRST: gl.constexpr, HALF: gl.constexpr):
        """Half ``HALF`` of S = Q K^T over key buffer ``buf`` (chunks 0-3, or 4-7 and the rope chunk with
        Q's rope columns from registers: their shared memory holds the odd tile's P), async; ``FIRST``:
        the half issued first. ``z`` is zero: in the loops the compiler cannot see it, so it builds the
        MMA operands' descriptors there instead of holding ~70 of them in registers (they spilled)."""
        if HALF == 0:
            for j in gl.static_range(4):
                k = k_smem.index(buf * _CHUNKS + j).permute((1, 0))
                s = warpgroup_mma(q_smem.index(j + z), k, s, use_acc=(FIRST == 1) or (j > 0), is_async=True)
        else:
            for j in gl.static_range(4, _CHUNKS - 1):
                k = k_smem.index(buf * _CHUNKS + j).permute((1, 0))
                s = warpgroup_mma(q_smem.index(j + z), k, s, use_acc=(FIRST == 0) or (j > 4), is_async=True)
            k = k_smem.index(buf * _CHUNKS + _CHUNKS - 1).permute((1, 0))
            s = warpgroup_mma(q_rope, k, s, is_async=True)
        return s

    @gluon.jit
    def _row_sums(l_i, mine, other, l_ready, layout: gl.constexpr):
        """The softmax denominators: each warpgroup holds the row sums of its own tiles, in the same
        units; both get the total."""
        mine.store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(l_ready)
        mbarrier.wait(l_ready, 0)
        return l_i + other.load(layout)

    @gluon.jit
    def _wg0(q_smem, k_smem, p0_smem, m_smem, sc0_smem, sc1_smem, l0_smem, l1_smem, q_ready, k_ready, kv_empty,
             sc0_ready, sc1_ready, p0_ready, p1_ready, l_ready, out_ptr, part_out_ptr, part_ml_ptr, qk_scale, seq,
             head0, split, num_heads, num_splits, lo, hi, n_tiles, stride_ob, stride_oh,
             SPLIT: gl.constexpr):  # fmt: skip
        """Even tiles' QK^T and softmax; PV for latent columns 0-255 (O_L) over both tiles of each pair."""
        dtype: gl.constexpr = q_smem.dtype
        keys = gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(0, _S_LAYOUT))
        m_i = gl.full([_HEADS], float("-inf"), gl.float32, _ROW_LAYOUT)
        l_i = gl.zeros([_HEADS], gl.float32, _ROW_LAYOUT)
        acc = gl.zeros([_HEADS, 4 * _COLS], gl.float32, _O_LAYOUT)
        s = gl.zeros([_HEADS, _BLOCK_N], gl.float32, _S_LAYOUT)
        mbarrier.wait(q_ready, 0)
        q_rope = q_smem.index(_CHUNKS - 1).load(_Q_LAYOUT)  # before the odd warpgroup's P takes its place
        if n_tiles > 0:
            mbarrier.wait(k_ready.index(0), 0)
            s = _qk(q_smem, q_rope, k_smem, 0, 0, s, 0, 0)
            mbarrier.wait(k_ready.index(1), 0)
            s = _qk(q_smem, q_rope, k_smem, 0, 0, s, 0, 1)
            s = warpgroup_mma_wait(0, deps=[s])
        for p in range(gl.cdiv(n_tiles, 2)):
            t = 2 * p
            z = p >> 24  # zero (see _qk)
            # softmax of tile t against the running max; the max and the old accumulators' factor to WG1
            sv = gl.where((lo + t * _BLOCK_N + keys < hi)[None, :], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(sv, axis=1))
            scale0 = gl.exp2(m_i - m_new)
            p0 = gl.exp2(sv - m_new[:, None])
            l_i = l_i * scale0 + gl.sum(p0, axis=1)
            m_smem.store(m_new)
            sc0_smem.store(scale0)
            gl.thread_barrier()
            mbarrier.arrive(sc0_ready)
            # O_L = O_L * scale0 + P0 V0_L; then buffer 0's left half is free
            acc = acc * gl.convert_layout(scale0, _O_ROW_LAYOUT)[:, None]
            p0_op = gl.convert_layout(p0.to(dtype), _P_LAYOUT)
            acc = warpgroup_mma(p0_op, _half(k_smem, z, 0), acc, is_async=True)
            acc, p0_op = warpgroup_mma_wait(0, deps=[acc, p0_op])
            mbarrier.arrive(kv_empty.index(0))
            # WG1's max over tile t + 1: P0 in its units for WG1's right half, and O_L rescaled
            mbarrier.wait(sc1_ready, p & 1)
            scale1 = sc1_smem.load(_ROW_LAYOUT)
            m_i = m_smem.load(_ROW_LAYOUT)
            p0_smem.store((p0 * scale1[:, None]).to(dtype))
            fence_async_shared()  # P0 is read by WG1's MMA (the async proxy)
            gl.thread_barrier()
            mbarrier.arrive(p0_ready)
            l_i = l_i * scale1
            acc = acc * gl.convert_layout(scale1, _O_ROW_LAYOUT)[:, None]
            # O_L += P1 V1_L (P1 from WG1, in Q's rope chunk), then the next even tile's QK^T, its left
            # chunks first (refilled first); buffer 1's left half is free once that PV is done
            if t + 2 < n_tiles:
                mbarrier.wait(p1_ready, p & 1)
                acc = warpgroup_mma(q_smem.index(_CHUNKS - 1), _half(k_smem, 1 + z, 0), acc, is_async=True)
                mbarrier.wait(k_ready.index(0), (p + 1) & 1)
                s = _qk(q_smem, q_rope, k_smem, z, z, s, 0, 0)
                acc = warpgroup_mma_wait(4, deps=[acc])
                mbarrier.arrive(kv_empty.index(2))
                mbarrier.wait(k_ready.index(1), (p + 1) & 1)
                s = _qk(q_smem, q_rope, k_smem, z, z, s, 0, 1)
                s = warpgroup_mma_wait(0, deps=[s])
            elif t + 1 < n_tiles:
                mbarrier.wait(p1_ready, p & 1)
                acc = warpgroup_mma(q_smem.index(_CHUNKS - 1), _half(k_smem, 1 + z, 0), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
        l_i = _row_sums(l_i, l0_smem, l1_smem, l_ready, _ROW_LAYOUT)
        _store(acc, 0, seq, head0, split, num_heads, num_splits, out_ptr, part_out_ptr, stride_ob, stride_oh,
               gl.convert_layout(l_i, _O_ROW_LAYOUT), SPLIT, _O_LAYOUT)  # fmt: skip
        if SPLIT:  # the running max (natural-log units, as the merge kernel expects) and the denominator
            heads = head0 + gl.arange(0, _HEADS, layout=_ROW_LAYOUT)
            row = (seq * num_heads + heads) * num_splits + split
            gl.store(part_ml_ptr + 2 * row, m_i * 0.6931471805599453, mask=heads < num_heads)
            gl.store(part_ml_ptr + 2 * row + 1, l_i, mask=heads < num_heads)

    @gluon.jit
    def _wg1(q_smem, k_smem, p0_smem, m_smem, sc0_smem, sc1_smem, l0_smem, l1_smem, q_ready, k_ready, kv_empty,
             sc0_ready, sc1_ready, p0_ready, p1_ready, l_ready, out_ptr, part_out_ptr, qk_scale, seq, head0, split,
             num_heads, num_splits, lo, hi, n_tiles, stride_ob, stride_oh, SPLIT: gl.constexpr):  # fmt: skip
        """Odd tiles' QK^T and softmax; PV for latent columns 256-511 (O_R) over both tiles of each pair."""
        dtype: gl.constexpr = q_smem.dtype
        keys = gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(0, _S_LAYOUT))
        l_i = gl.zeros([_HEADS], gl.float32, _ROW_LAYOUT)
        acc = gl.zeros([_HEADS, 4 * _COLS], gl.float32, _O_LAYOUT)
        s = gl.zeros([_HEADS, _BLOCK_N], gl.float32, _S_LAYOUT)
        mbarrier.wait(q_ready, 0)
        q_rope = q_smem.index(_CHUNKS - 1).load(_Q_LAYOUT)
        if n_tiles > 1:  # the right chunks first: the order buffer 1's halves are refilled in
            mbarrier.wait(k_ready.index(3), 0)
            s = _qk(q_smem, q_rope, k_smem, 1, 0, s, 1, 1)
            mbarrier.wait(k_ready.index(2), 0)
            s = _qk(q_smem, q_rope, k_smem, 1, 0, s, 1, 0)
            s = warpgroup_mma_wait(0, deps=[s])
        for p in range(gl.cdiv(n_tiles, 2)):
            t = 2 * p + 1
            z = p >> 24
            has1 = t < n_tiles
            mbarrier.wait(sc0_ready, p & 1)
            m_old = m_smem.load(_ROW_LAYOUT)
            scale0 = sc0_smem.load(_ROW_LAYOUT)
            # past the tiles (an odd count) every key is masked: the max stays, P1 is zero, the factor 1
            sv = gl.where((lo + t * _BLOCK_N + keys < hi)[None, :], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_old, gl.max(sv, axis=1))
            scale1 = gl.exp2(m_old - m_new)
            p1 = gl.exp2(sv - m_new[:, None])
            m_smem.store(m_new)
            sc1_smem.store(scale1)
            gl.thread_barrier()
            mbarrier.arrive(sc1_ready)
            factor = scale0 * scale1
            l_i = l_i * factor + gl.sum(p1, axis=1)
            acc = acc * gl.convert_layout(factor, _O_ROW_LAYOUT)[:, None]
            if has1:  # P1 to WG0 through Q's rope chunk (both warpgroups hold those columns in registers)
                p1_16 = p1.to(dtype)
                q_smem.index(_CHUNKS - 1).store(p1_16)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(p1_ready)
                p1_op = gl.convert_layout(p1_16, _P_LAYOUT)
                acc = warpgroup_mma(p1_op, _half(k_smem, 1 + z, 1), acc, is_async=True)
                mbarrier.wait(p0_ready, p & 1)
                acc = warpgroup_mma(p0_smem, _half(k_smem, z, 1), acc, is_async=True)
                p1_op = warpgroup_mma_wait(1, deps=[p1_op])
                mbarrier.arrive(kv_empty.index(3))
                acc = warpgroup_mma_wait(0, deps=[acc])
            else:
                mbarrier.wait(p0_ready, p & 1)
                acc = warpgroup_mma(p0_smem, _half(k_smem, z, 1), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(kv_empty.index(1))
            if t + 2 < n_tiles:
                mbarrier.wait(k_ready.index(3), (p + 1) & 1)
                s = _qk(q_smem, q_rope, k_smem, 1 + z, z, s, 1, 1)
                mbarrier.wait(k_ready.index(2), (p + 1) & 1)
                s = _qk(q_smem, q_rope, k_smem, 1 + z, z, s, 1, 0)
                s = warpgroup_mma_wait(0, deps=[s])
        l_i = _row_sums(l_i, l1_smem, l0_smem, l_ready, _ROW_LAYOUT)
        _store(acc, 256, seq, head0, split, num_heads, num_splits, out_ptr, part_out_ptr, stride_ob, stride_oh,
               gl.convert_layout(l_i, _O_ROW_LAYOUT), SPLIT, _O_LAYOUT)  # fmt: skip

    @gluon.jit(
        do_not_specialize=["num_splits", "stride_tb"],
        do_not_specialize_on_alignment=["seq_lens_ptr", "tables_ptr"],
    )
    def _mla_decode_gluon_kernel(q_desc, c_desc, seq_lens_ptr, tables_ptr, out_ptr, part_out_ptr, part_ml_ptr,
                                  qk_scale, num_heads, num_splits, stride_tb, stride_ob, stride_oh,
                                  PAGE: gl.constexpr, ROWS: gl.constexpr, SPLIT: gl.constexpr,
                                  WG1_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):  # fmt: skip
        dtype: gl.constexpr = q_desc.dtype
        head0 = gl.program_id(0) * _HEADS
        seq = gl.program_id(1).to(gl.int64)
        split = gl.program_id(2)
        seq_len, lo, hi, n_tiles = split_range(seq_lens_ptr, seq, split, num_splits)
        q_row = (seq * num_heads + head0).to(gl.int32)

        q_smem = gl.allocate_shared_memory(dtype, [_CHUNKS, _HEADS, _COLS], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2 * _CHUNKS, _BLOCK_N, _COLS], q_desc.layout)
        p0_smem = gl.allocate_shared_memory(dtype, [_HEADS, _BLOCK_N], q_desc.layout)
        vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        m_smem = gl.allocate_shared_memory(gl.float32, [_HEADS], vec)
        sc0_smem = gl.allocate_shared_memory(gl.float32, [_HEADS], vec)
        sc1_smem = gl.allocate_shared_memory(gl.float32, [_HEADS], vec)
        l0_smem = gl.allocate_shared_memory(gl.float32, [_HEADS], vec)
        l1_smem = gl.allocate_shared_memory(gl.float32, [_HEADS], vec)
        bars = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(6):
            mbarrier.init(bars.index(i), count=2 if i == 5 else 1)  # l_ready: both warpgroups
        for i in gl.static_range(4):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=1)
        q_ready = bars.index(0)
        sc0_ready = bars.index(1)
        sc1_ready = bars.index(2)
        p0_ready = bars.index(3)
        p1_ready = bars.index(4)
        l_ready = bars.index(5)
        gl.warp_specialize(
            [
                (_wg0, (q_smem, k_smem, p0_smem, m_smem, sc0_smem, sc1_smem, l0_smem, l1_smem, q_ready, k_ready,
                        kv_empty, sc0_ready, sc1_ready, p0_ready, p1_ready, l_ready, out_ptr, part_out_ptr,
                        part_ml_ptr, qk_scale, seq, head0, split, num_heads, num_splits, lo, hi, n_tiles, stride_ob,
                        stride_oh, SPLIT)),
                (_wg1, (q_smem, k_smem, p0_smem, m_smem, sc0_smem, sc1_smem, l0_smem, l1_smem, q_ready, k_ready,
                        kv_empty, sc0_ready, sc1_ready, p0_ready, p1_ready, l_ready, out_ptr, part_out_ptr, qk_scale,
                        seq, head0, split, num_heads, num_splits, lo, hi, n_tiles, stride_ob, stride_oh, SPLIT)),
                (_loader, (q_desc, c_desc, q_smem, k_smem, q_ready, k_ready, kv_empty, tables_ptr, stride_tb,
                              q_row, seq, lo, n_tiles, seq_len - 1, PAGE, ROWS)),
            ],
            [4, 1],
            [WG1_REGS, LOADER_REGS],
        )  # fmt: skip


def head_blocks(num_heads: int) -> int:
    """Programs per sequence and split: 64 heads each (one, padded, below 64)."""
    return max(1, num_heads // HEADS)


def num_splits(device: torch.device, num_seqs: int, num_heads: int) -> int:
    """Context splits: the largest power of two keeping the programs (one per SM: their shared
    memory) within the SMs, at most 32."""
    fill = min(prefill_attention_gluon._num_sms(device.index or 0) // (num_seqs * head_blocks(num_heads)), 32)
    return 1 if fill < 2 else 1 << (fill.bit_length() - 1)


def mla_decode_gluon(q, kv_cache, seq_lens, block_tables, scale, splits=None, config=None, k_scale=None):
    """``atom.ops.triton.mla_decode`` for the inputs ``supported`` accepts: q [B, H, 576], returns
    [B, H, 512]. ``splits``: context splits (from the SM count when None). Split partial results merge
    in ``mla_merge``. 16 or 32 heads go to ``mla_gluon_narrow`` (heads as the MMA's N), which also
    takes an fp8 cache (``k_scale``: its scale, 1 when None).
    ``config``: register counts of WG1 and of the loader partition (``wg1_regs``, ``loader_regs``; WG0
    gets what is left); ``narrow``: False keeps few heads on this kernel."""
    cfg = {"wg1_regs": 232, "loader_regs": 24, "narrow": True, **(config or {})}
    num_seqs, num_heads, dim = q.shape
    out = torch.empty(num_seqs, num_heads, RANK, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    q = q.contiguous()
    splits = splits or num_splits(q.device, num_seqs, num_heads)
    if cfg["narrow"] and mla_gluon_narrow.supported(num_heads):
        return mla_gluon_narrow.mla_decode_narrow(q, kv_cache, seq_lens, block_tables, scale, splits, cfg, out,
                                                  k_scale)  # fmt: skip
    if kv_cache.dtype == FP8:
        raise ValueError(f"an fp8 latent cache decodes through the narrow kernel (16 or 32 heads), not {num_heads}")
    q_desc, c_desc, page, rows, part_out, part_ml = operands(q, kv_cache, splits, out, HEADS)
    _mla_decode_gluon_kernel[(head_blocks(num_heads), num_seqs, splits)](
        q_desc, c_desc, seq_lens, block_tables, out, part_out, part_ml, scale * LOG2E, num_heads, splits,
        block_tables.stride(0), out.stride(0), out.stride(1), PAGE=page, ROWS=rows, SPLIT=splits > 1,
        WG1_REGS=cfg["wg1_regs"], LOADER_REGS=cfg["loader_regs"], num_warps=4,
    )  # fmt: skip
    if splits > 1:
        merge_splits(out, part_out, part_ml)
    return out
