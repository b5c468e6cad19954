"""MLA decode for Hopper with few heads (16 or 32: DeepSeek-V2-Lite, Moonlight, V3 at ``-tp 8`` / ``-tp 4``),
written in Gluon; ``mla_gluon.py`` keeps 64 heads and more.

With one query a sequence, a 64-row MMA over 16 heads does four times the work it needs (the rows
past the heads are padding), and at 16 heads that padded work is as long as the latent read itself.
This kernel turns the products around so the heads are the MMA's N dimension (8 to 256 wide):

- S^T = K Q^T: A is the key tile in shared memory (64 keys x 576), B is Q^T (its chunks, permuted);
- the online softmax runs down S^T's columns (one per head);
- O^T = V^T P^T: A is the same key tile read transposed ([512, 64], the latent's 64-column chunks
  are the 128-byte swizzle atoms of a 512-column tile), B is P^T from shared memory; the 512 x H
  float32 accumulator is 4H registers a thread in one warpgroup.

The MMA work a tile drops from 64 x 64 x 1088 to 64 x H x 1088, so the kernel is bound by the
latent read: a one-warp loader keeps two 64-key tiles in flight with bulk tensor copies (TMA), each
refilled once the math warpgroup's PV over it is done. Same inputs, splits and partial-result
format as ``mla_gluon.py`` (merged by ``mla_merge``).

An fp8 latent cache (``--kv-cache-dtype fp8``: e4m3 rows divided by the layer's ``k_scale``) halves
the read: three 36 KiB fp8 stages in flight; the math warpgroup widens each tile into one fp16 tile
chunk by chunk, each chunk's QK^T MMA running while the next one widens, frees the stage, and runs
the PV in fp16 too; ``k_scale`` folds into the softmax scale and the output. e4m3 widens to fp16 in
one conversion (to bf16 in two), and fp16 MMAs ran 1.3-1.6x the bf16 ones from batch 8 (session 28,
H200): a bf16 query is converted once in shared memory, saturated to fp16's range (65,504; FlashMLA's
fp8 path quantises the query to e4m3, whose range is 448).
"""

from __future__ import annotations

import torch

from atom.ops.triton.mla_gluon_base import BLOCK_N, CHUNKS, COLS, FP8, HAVE_GLUON, LOG2E, RANK, operands
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

HEADS = (16, 32)  # head counts this kernel takes (the MMA's N)
STAGES = 2  # key tiles in shared memory (72 KiB each)
FP8_STAGES = 3  # of an fp8 cache (36 KiB each, beside the one widened 16-bit tile)


def supported(num_heads: int) -> bool:
    return num_heads in HEADS


if HAVE_GLUON:
    _BLOCK_N = gl.constexpr(BLOCK_N)
    _COLS = gl.constexpr(COLS)
    _CHUNKS = gl.constexpr(CHUNKS)
    _RANK = gl.constexpr(RANK)

    @gluon.jit
    def _loader(q_desc, c_desc, q_smem, ring, q_ready, k_ready, kv_empty, tables_ptr, stride_tb, q_row, seq, lo,
                n_tiles, last_key, PAGE: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        """Q once (nine 64-column chunks), then tile ``t`` into stage ``t % STAGES`` of the ring once the
        tile before it there is used up; each tile in boxes of ``ROWS`` keys (a page or 64 rows)."""
        mbarrier.expect(q_ready, _CHUNKS * q_desc.block_type.nbytes)
        for j in gl.static_range(_CHUNKS):
            tma.async_copy_global_to_shared(q_desc, [q_row, j * _COLS], q_ready, q_smem.index(j))
        last_box = (last_key // ROWS) * ROWS
        for t in range(n_tiles):
            stage = t % STAGES
            if t >= STAGES:
                mbarrier.wait(kv_empty.index(stage), (t // STAGES - 1) & 1)
            bar = k_ready.index(stage)
            mbarrier.expect(bar, _CHUNKS * (_BLOCK_N // ROWS) * c_desc.block_type.nbytes)
            for i in gl.static_range(_BLOCK_N // ROWS):
                key = gl.minimum(lo + t * _BLOCK_N + i * ROWS, last_box)  # past the sequence: masked
                page = gl.load(tables_ptr + seq * stride_tb + key // PAGE)
                row = page * PAGE + key % PAGE
                for j in gl.static_range(_CHUNKS):
                    tma.async_copy_global_to_shared(c_desc, [row, j * _COLS], bar,
                                                    ring.index(stage * _CHUNKS + j).slice(i * ROWS, ROWS))

    @gluon.jit
    def _math(q_smem, ring, k_smem, p_smem, q_ready, k_ready, kv_empty, k_scale_ptr, out_ptr, part_out_ptr,
              part_ml_ptr, qk_scale, seq, split, num_heads, num_splits, lo, hi, n_tiles, stride_ob, stride_oh,
              N: gl.constexpr, SPLIT: gl.constexpr, ACC: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr,
              HAS_SCALE: gl.constexpr, CONVERT_Q: gl.constexpr):  # fmt: skip
        """Per tile: S^T = K Q^T, its softmax down the columns, O^T = O^T * factor + V^T P^T. An fp8
        ring's tile is widened chunk by chunk into ``k_smem`` (fp16: e4m3 widens in one conversion),
        chunk j + 1 while chunk j's QK^T MMA runs, and its stage freed once read; the cache's scale
        folds into the softmax scale and the output."""
        dtype: gl.constexpr = k_smem.dtype  # the MMAs' (fp16 over an fp8 cache)
        WIDEN: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # 16 bytes a thread a row
        col: gl.constexpr = gl.SliceLayout(0, ACC)  # one value a head
        keys = gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(1, ACC))
        m_i = gl.full([N], float("-inf"), gl.float32, col)
        l_i = gl.zeros([N], gl.float32, col)
        acc = gl.zeros([_RANK, N], gl.float32, ACC)
        s = gl.zeros([_BLOCK_N, N], gl.float32, ACC)
        if HAS_SCALE:
            qk_scale = qk_scale * gl.load(k_scale_ptr)
        mbarrier.wait(q_ready, 0)
        if CONVERT_Q:  # a bf16 query to fp16 in place, saturated to fp16's range (FlashMLA's fp8 path: e4m3's)
            QCONV: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16 x 64, no thread twice
            q16 = q_smem._reinterpret(gl.float16, [_CHUNKS, N, _COLS], q_smem.layout)
            for j in gl.static_range(_CHUNKS):
                x = q_smem.index(j).load(QCONV).to(gl.float32)
                q16.index(j).store(gl.minimum(gl.maximum(x, -65504.0), 65504.0).to(gl.float16))
            fence_async_shared()  # read by the MMAs (the async proxy)
            gl.thread_barrier()
            q_smem = q16
        for t in range(n_tiles):
            stage = t % STAGES
            mbarrier.wait(k_ready.index(stage), (t // STAGES) & 1)
            if FP8:
                # a zero the compiler cannot see: the one tile's MMA descriptors, hoisted out of the
                # loop, would spill
                first = (t >> 24) * _CHUNKS
                for j in gl.static_range(_CHUNKS):
                    k_smem.index(first + j).store(ring.index(stage * _CHUNKS + j).load(WIDEN).to(dtype))
                    fence_async_shared()  # the widened chunk is read by the MMA (the async proxy)
                    gl.thread_barrier()
                    s = warpgroup_mma(k_smem.index(first + j), q_smem.index(j).permute((1, 0)), s,
                                      use_acc=j > 0, is_async=True)  # fmt: skip
                mbarrier.arrive(kv_empty.index(stage))  # read: the loader may refill it
            else:
                first = stage * _CHUNKS
                for j in gl.static_range(_CHUNKS):
                    s = warpgroup_mma(k_smem.index(first + j), q_smem.index(j).permute((1, 0)), s,
                                      use_acc=j > 0, is_async=True)  # fmt: skip
            s = warpgroup_mma_wait(0, deps=[s])
            sv = gl.where((lo + t * _BLOCK_N + keys < hi)[:, None], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(sv, axis=0))
            factor = gl.exp2(m_i - m_new)
            p = gl.exp2(sv - m_new[None, :])
            l_i = l_i * factor + gl.sum(p, axis=0)
            m_i = m_new
            acc = acc * factor[None, :]
            p_smem.store(p.to(dtype))
            fence_async_shared()  # P^T is read by the MMA (the async proxy)
            gl.thread_barrier()
            v_t = k_smem.index(first)._reinterpret(dtype, [_BLOCK_N, _RANK], k_smem.layout).permute((1, 0))
            acc = warpgroup_mma(v_t, p_smem, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            if not FP8:
                mbarrier.arrive(kv_empty.index(stage))
        if HAS_SCALE:
            acc = acc * gl.load(k_scale_ptr)
        cols = gl.arange(0, _RANK, layout=gl.SliceLayout(1, ACC))
        heads = gl.arange(0, N, layout=col)  # N is the head count
        if SPLIT:  # unnormalised sums, the running max (natural-log units) and the denominator
            row = (seq * num_heads + heads) * num_splits + split
            gl.store(part_out_ptr + row[None, :] * _RANK + cols[:, None], acc)
            gl.store(part_ml_ptr + 2 * row, m_i * 0.6931471805599453)
            gl.store(part_ml_ptr + 2 * row + 1, l_i)
        else:
            offs = seq * stride_ob + heads[None, :] * stride_oh + cols[:, None]
            gl.store(out_ptr + offs, (acc / l_i[None, :]).to(out_ptr.dtype.element_ty))

    @gluon.jit(
        do_not_specialize=["num_splits", "stride_tb"],
        do_not_specialize_on_alignment=["seq_lens_ptr", "tables_ptr"],
    )
    def _mla_decode_narrow_kernel(q_desc, c_desc, seq_lens_ptr, tables_ptr, k_scale_ptr, out_ptr, part_out_ptr,
                                   part_ml_ptr, qk_scale, num_heads, num_splits, stride_tb, stride_ob, stride_oh,
                                   PAGE: gl.constexpr, ROWS: gl.constexpr, SPLIT: gl.constexpr, N: gl.constexpr,
                                   LOADER_REGS: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr,
                                   HAS_SCALE: gl.constexpr, CONVERT_Q: gl.constexpr):  # fmt: skip
        # built here, not passed in: a layout argument breaks the JIT cache hook torch.compile sets
        # (it writes the specialisation as JSON). S^T and O^T: wgmma accumulators N wide; P^T [64, N]:
        # rows of 2N bytes, swizzled as wide
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
        P_LAYOUT: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * N, element_bitwidth=16, rank=2)
        dtype: gl.constexpr = q_desc.dtype
        mma: gl.constexpr = gl.float16 if FP8 else dtype  # e4m3 widens to fp16 in one conversion, to bf16 in two
        seq = gl.program_id(0).to(gl.int64)
        split = gl.program_id(1)
        seq_len, lo, hi, n_tiles = split_range(seq_lens_ptr, seq, split, num_splits)
        q_row = (seq * num_heads).to(gl.int32)

        q_smem = gl.allocate_shared_memory(dtype, [_CHUNKS, N, _COLS], q_desc.layout)
        ring = gl.allocate_shared_memory(c_desc.dtype, [STAGES * _CHUNKS, _BLOCK_N, _COLS], c_desc.layout)
        if FP8:
            k_smem = gl.allocate_shared_memory(mma, [_CHUNKS, _BLOCK_N, _COLS], q_desc.layout)
        else:
            k_smem = ring
        p_smem = gl.allocate_shared_memory(mma, [_BLOCK_N, N], P_LAYOUT)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=1)
        gl.warp_specialize(
            [
                (_math, (q_smem, ring, k_smem, p_smem, q_ready, k_ready, kv_empty, k_scale_ptr, out_ptr, part_out_ptr,
                         part_ml_ptr, qk_scale, seq, split, num_heads, num_splits, lo, hi, n_tiles, stride_ob,
                         stride_oh, N, SPLIT, ACC, STAGES, FP8, HAS_SCALE, CONVERT_Q)),
                (_loader, (q_desc, c_desc, q_smem, ring, q_ready, k_ready, kv_empty, tables_ptr, stride_tb, q_row,
                           seq, lo, n_tiles, seq_len - 1, PAGE, ROWS, STAGES)),
            ],
            [1],
            [LOADER_REGS],
        )  # fmt: skip


def mla_decode_narrow(q, kv_cache, seq_lens, block_tables, scale, splits, cfg, out, k_scale=None):
    """``mla_gluon.mla_decode_gluon`` for 16 or 32 heads (at least one sequence): q [B, H, 576]
    (contiguous, 16-bit) into ``out`` [B, H, 512]; the cache 16-bit like q, or fp8 (e4m3, the rows
    divided by ``k_scale``)."""
    num_seqs, num_heads, _ = q.shape
    fp8 = kv_cache.dtype == FP8
    q_desc, c_desc, page, rows, part_out, part_ml = operands(q, kv_cache, splits, out, num_heads)
    has_scale = fp8 and k_scale is not None
    _mla_decode_narrow_kernel[(num_seqs, splits)](
        q_desc, c_desc, seq_lens, block_tables, k_scale if has_scale else seq_lens, out, part_out, part_ml,
        scale * LOG2E, num_heads, splits, block_tables.stride(0), out.stride(0), out.stride(1), PAGE=page, ROWS=rows,
        SPLIT=splits > 1, N=num_heads, LOADER_REGS=cfg["loader_regs"], STAGES=FP8_STAGES if fp8 else STAGES,
        FP8=fp8, HAS_SCALE=has_scale, CONVERT_Q=fp8 and q.dtype == torch.bfloat16, num_warps=4,
    )  # fmt: skip
    if splits > 1:
        merge_splits(out, part_out, part_ml)
    return out
