"""Causal prefill attention for Hopper written in Gluon, FlashAttention-3 style.

Scope: prefill chunks whose own K/V are packed ``[tokens, kv_heads, head_dim]``, several
sequences per launch (``cu_seqlens``), each after a cached prefix read page by page from the
paged cache (or none), head_dim 64/128, 16-bit inputs, sm_90. Everything else stays on
``atom.ops.triton.prefill_attention``.

Each program owns 128 query rows of one query head and runs three partitions:

- a one-warp **loader** that issues bulk tensor copies (TMA) of Q once and of every K and V
  tile into a ``STAGES``-deep shared-memory ring, tracked by mbarriers (``k_ready``,
  ``v_ready`` per stage; ``kv_empty`` released by both consumers);
- two **consumer** warpgroups of 64 rows each (the default partition and a worker). Within
  a warpgroup, the QK^T of tile ``t`` and the PV of tile ``t - 1`` are issued as one async
  batch and the softmax of tile ``t`` runs while PV is on the tensor cores. With
  ``PINGPONG`` the two warpgroups also take turns issuing their MMAs (a pair of mbarriers
  passes the turn), so one warpgroup's softmax overlaps the other's MMAs.

Programs are persistent (one per SM) and take work items from a counter in global memory
(``DYNAMIC``; a static round robin left the busiest SM 15-20% over the mean at 2k-token
prompts): the loader takes the next item, decodes it and publishes its fields in shared
memory with Q (the consumers skip the dependent loads of decoding), and fills the K/V ring for
it while its consumers finish the last PV. Launches of few long items
(short chunks over long cached prefixes) split each item's key range over programs
(``num_splits``), and ``attention_merge.merge_splits`` combines the partial results.
``paged_attention`` runs every prefill launch it can here (docs/kernels.md has the measurements).

Key tiles are visited from the first (of the item's split); tiles that every row of a
warpgroup sees skip the causal mask, and every row sees key 0 of tile 0, so without splits
the running max is finite from the first tile on (a split may start past a row's keys: its
diagonal tiles guard the max). Tiles on the diagonal may read rows past the sequence (the next
sequence's keys, or zeros past the tensor): the causal mask hides them from every real query row.
Programs run heaviest (last) tiles first, query heads fastest, so the heads of one KV head
share K/V through L2.
"""

from __future__ import annotations

import functools
import os

import torch

from atom.ops.triton import counters
from atom.ops.triton.attention_merge import merge_splits, split_partials

try:  # Gluon and its Hopper module exist from Triton 3.5; the API used here is 3.6's
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _HAVE_GLUON = hasattr(gl, "warp_specialize") and hasattr(tma, "async_copy_global_to_shared")
except ImportError:  # pragma: no cover - depends on the installed Triton
    _HAVE_GLUON = False

HALF = 64  # query rows per consumer warpgroup
BLOCK_M = 2 * HALF
# measured on an H100 (docs/kernels.md): 3 stages of 128 keys, ping-pong, persistent
# dynamic: persistent programs take the next work item from a counter in global memory (static
# round robin left the busiest SM ~20% over the mean at q=2048, 32 heads, 132 SMs)
DEFAULT_CONFIG = dict(block_n=128, stages=3, pingpong=True, persistent=True, consumer_regs=232, loader_regs=24,
                      dynamic=True, q_regs=False)


def available(device: torch.device | None = None) -> bool:
    """Whether the Gluon kernel can run here: Triton with Gluon's Hopper module, a CUDA
    device of compute capability 9.x, and not the interpreter."""
    if not _HAVE_GLUON or os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    if device is not None and device.type != "cuda":
        return False
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return _capability(index)[0] == 9


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Shapes and dtypes the kernel handles (packed K/V that can back a descriptor)."""
    tokens, q_heads, head_dim = q.shape
    return (q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v.dtype == q.dtype
            and head_dim in (64, 128) and k.shape[0] == tokens and q_heads % k.shape[1] == 0
            and all(t.stride(2) == 1 and t.stride(1) == head_dim and (t.stride(0) * t.element_size()) % 16 == 0
                    and t.data_ptr() % 16 == 0 for t in (q, k, v)))  # fmt: skip


if _HAVE_GLUON:
    _HALF = gl.constexpr(HALF)  # kernels read module constants only as constexpr
    _BLOCK_M = gl.constexpr(BLOCK_M)
    ITEM_FIELDS = gl.constexpr(16)  # a published work item: 9 int32 fields, padded to a power of two

    @gluon.jit
    def _find_seq(cu_seqlens_ptr, q_base, tile, num_seqs, BLOCK: gl.constexpr):
        """Largest ``i`` with ``(cu_seqlens[i] - q_base) // BLOCK + i <= tile`` (tiles of each
        sequence are numbered after those of the sequences before it, one spare per sequence)."""
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if (gl.load(cu_seqlens_ptr + mid) - q_base) // BLOCK + mid <= tile:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @gluon.jit
    def _work_item(w, cu_seqlens_ptr, seq_lens_ptr, num_seqs, num_q_heads, num_slots, num_splits,
                   HAS_CACHE: gl.constexpr):  # fmt: skip
        """Work item ``w`` -> (query head, key-range split, sequence, first token of its sequence,
        its query rows, its cached prefix length, first query row): query tiles heaviest (last)
        first, then splits, query heads fastest."""
        tile = num_slots - 1 - w // (num_q_heads * num_splits)
        q_base = gl.load(cu_seqlens_ptr)  # a slice of the batch's metadata may not start at 0
        seq = _find_seq(cu_seqlens_ptr, q_base, tile, num_seqs, _BLOCK_M)
        tok0 = gl.load(cu_seqlens_ptr + seq) - q_base
        q_len = gl.load(cu_seqlens_ptr + seq + 1) - q_base - tok0
        ctx = 0
        if HAS_CACHE:
            ctx = gl.load(seq_lens_ptr + seq) - q_len
        first_q = (tile - (tok0 // _BLOCK_M + seq)) * _BLOCK_M
        return w % num_q_heads, (w // num_q_heads) % num_splits, seq, tok0, q_len, ctx, first_q

    @gluon.jit
    def _key_range(ctx, first_q, q_len, split, num_splits, BLOCK_N: gl.constexpr):
        """Key tiles [lo, hi) of a work item: those its query rows may see (causal), cut into
        ``num_splits`` near-equal parts (an item with fewer tiles than splits has empty ones)."""
        n_tiles = gl.cdiv(ctx + gl.minimum(first_q + _BLOCK_M, q_len), BLOCK_N)
        return split * n_tiles // num_splits, (split + 1) * n_tiles // num_splits

    @gluon.jit
    def _mark_empty(part_max_ptr, part_sum_ptr, tok0, first_q, q_len, head, split, num_q_heads, num_splits):
        """An empty split of a work item: its rows' partial max -inf and sum 0 (the merge weighs it
        0 and reads no output row for it; the buffers are not initialised)."""
        layout: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
        rows = first_q + gl.arange(0, _BLOCK_M, layout=layout)
        offs = ((tok0 + rows).to(gl.int64) * num_q_heads + head) * num_splits + split
        gl.store(part_max_ptr + offs, gl.full([_BLOCK_M], float("-inf"), gl.float32, layout), mask=rows < q_len)
        gl.store(part_sum_ptr + offs, gl.zeros([_BLOCK_M], gl.float32, layout), mask=rows < q_len)

    @gluon.jit
    def _load_pages(c_desc, table, seq_len, kv_row, stride_cb, t, bar, dst, PAGE: gl.constexpr,
                    ROWS: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
        """Key tile ``t`` from the paged cache into ``dst``: one copy of ``ROWS`` rows per page
        (or per tile, for pages of a tile or more). Boxes past the sequence read the box of its
        last key instead (keys the causal mask hides), so no block-table padding is followed."""
        last_box = ((seq_len - 1) // ROWS) * ROWS
        for i in gl.static_range(BLOCK_N // ROWS):
            key = gl.minimum(t * BLOCK_N + i * ROWS, last_box)
            page = gl.load(table + key // PAGE)
            tma.async_copy_global_to_shared(c_desc, [page * stride_cb + kv_row + key % PAGE, 0], bar,
                                            dst.slice(i * ROWS, ROWS))  # fmt: skip

    @gluon.jit
    def _publish(item_smem, w, head, split, tok0, q_len, ctx, first_q, lo, hi):
        """The loader warp writes work item ``w``, decoded, for the consumers (who read it after
        ``q_ready``): they skip the chain of dependent loads that decoding takes."""
        layout: gl.constexpr = gl.BlockedLayout([ITEM_FIELDS], [32], [1], [0])
        i = gl.arange(0, ITEM_FIELDS, layout=layout)
        fields = gl.where(i == 0, w, gl.where(i == 1, head, gl.where(i == 2, split, gl.where(i == 3, tok0, gl.where(
            i == 4, q_len, gl.where(i == 5, ctx, gl.where(i == 6, first_q, gl.where(i == 7, lo, hi))))))))
        item_smem.store(fields)

    @gluon.jit
    def _read_item(item_smem):
        """The work item a consumer warpgroup's ``q_ready`` phase announced: (w, head, split, tok0,
        q_len, ctx, first_q, lo, hi), every thread holding all fields."""
        layout: gl.constexpr = gl.BlockedLayout([ITEM_FIELDS], [32], [4], [0])
        fields = item_smem.load(layout)
        i = gl.arange(0, ITEM_FIELDS, layout=layout)
        return (gl.sum(gl.where(i == 0, fields, 0), axis=0), gl.sum(gl.where(i == 1, fields, 0), axis=0),
                gl.sum(gl.where(i == 2, fields, 0), axis=0), gl.sum(gl.where(i == 3, fields, 0), axis=0),
                gl.sum(gl.where(i == 4, fields, 0), axis=0), gl.sum(gl.where(i == 5, fields, 0), axis=0),
                gl.sum(gl.where(i == 6, fields, 0), axis=0), gl.sum(gl.where(i == 7, fields, 0), axis=0),
                gl.sum(gl.where(i == 8, fields, 0), axis=0))  # fmt: skip

    @gluon.jit
    def _loader(q_desc, k_desc, v_desc, kc_desc, vc_desc, q_smem, k_smem, v_smem, item_smem, q_ready, q_empty,
                k_ready, v_ready, kv_empty, sched_ptr, part_max_ptr, part_sum_ptr, cu_seqlens_ptr, seq_lens_ptr,
                tables_ptr, stride_bt, stride_cb, stride_ch, num_seqs, num_q_heads, num_slots, num_splits,
                num_items, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                HAS_CACHE: gl.constexpr, PAGE: gl.constexpr, ROWS: gl.constexpr, DYNAMIC: gl.constexpr,
                SPLIT: gl.constexpr):  # fmt: skip
        c = 0  # key tiles loaded so far (ring position and phase)
        it = 0  # work items loaded so far
        w = gl.program_id(0)
        while w < num_items:
            head, split, seq, tok0, q_len, ctx, first_q = _work_item(w, cu_seqlens_ptr, seq_lens_ptr, num_seqs,
                                                                     num_q_heads, num_slots, num_splits,
                                                                     HAS_CACHE)  # fmt: skip
            lo, hi = _key_range(ctx, first_q, q_len, split, num_splits, BLOCK_N)
            if SPLIT:
                if first_q < q_len and lo >= hi:
                    _mark_empty(part_max_ptr, part_sum_ptr, tok0, first_q, q_len, head, split, num_q_heads,
                                num_splits)  # fmt: skip
            if first_q < q_len and lo < hi:
                # Q (and the item slot) are reused once both consumers are past the previous
                # item's last QK^T; the expect below releases the item to them with Q
                mbarrier.wait(q_empty, (it & 1) ^ 1, pred=it > 0)
                _publish(item_smem, w, head, split, tok0, q_len, ctx, first_q, lo, hi)
                mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [tok0 + first_q, head * HEAD_DIM], q_ready, q_smem.index(0))
                tma.async_copy_global_to_shared(q_desc, [tok0 + first_q + _HALF, head * HEAD_DIM], q_ready,
                                                q_smem.index(1))  # fmt: skip
                kv_col = (head // GROUP) * HEAD_DIM
                # tiles holding a cached key come from the paged cache, the rest from the chunk's
                # packed K/V (the tile at position t starts at packed row tok0 - ctx + t * BLOCK_N)
                paged_hi = 0
                if HAS_CACHE:
                    paged_hi = gl.cdiv(ctx, BLOCK_N)
                for t in range(lo, hi):
                    s = c % STAGES
                    # a stage is reused once both consumers have released its previous tile
                    mbarrier.wait(kv_empty.index(s), ((c // STAGES) & 1) ^ 1, pred=c >= STAGES)
                    mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                    if t < paged_hi:
                        table = tables_ptr + seq.to(gl.int64) * stride_bt
                        seq_len = ctx + q_len
                        kv_row = (head // GROUP) * stride_ch
                        _load_pages(kc_desc, table, seq_len, kv_row, stride_cb, t, k_ready.index(s), k_smem.index(s),
                                    PAGE, ROWS, BLOCK_N)  # fmt: skip
                        _load_pages(vc_desc, table, seq_len, kv_row, stride_cb, t, v_ready.index(s), v_smem.index(s),
                                    PAGE, ROWS, BLOCK_N)  # fmt: skip
                    else:
                        row = tok0 - ctx + t * BLOCK_N
                        tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_ready.index(s), k_smem.index(s))
                        tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_ready.index(s), v_smem.index(s))
                    c += 1
                it += 1
            if DYNAMIC:  # the next item no program has taken (items below the grid size start them)
                taken = gl.atomic_add(sched_ptr, 1)
                w = taken + gl.num_programs(0)
                # each program draws until it gets an item past the last, so a launch draws exactly
                # num_items times (grid <= num_items): the last draw zeroes the counter for the next
                if taken == num_items - 1:
                    gl.atomic_xchg(sched_ptr, 0)
            else:
                w += gl.num_programs(0)
        # no more work: the consumers read an item past the last
        mbarrier.wait(q_empty, (it & 1) ^ 1, pred=it > 0)
        _publish(item_smem, num_items, 0, 0, 0, 0, 0, 0, 0, 0)
        mbarrier.arrive(q_ready)

    @gluon.jit
    def _softmax(s, m_i, l_i, t, qk_scale, q_pos, mask_from, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
                 SPLIT: gl.constexpr):  # fmt: skip
        """Online-softmax step on the scores of key tile ``t``: returns P (unnormalised),
        the new running max and sum, and the factor that rescales the old accumulator."""
        if t >= mask_from:  # tiles on the causal diagonal
            offs_n = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where(offs_n[None, :] <= q_pos[:, None], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            if SPLIT:  # a split may start past a row's last key: the row keeps p = 0 and max -inf
                m_new = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s - m_new[:, None])
        else:  # scale folded into one FMA per score
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
            p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha

    @gluon.jit
    def _consume_item(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, q, k_smem, v_smem, q_empty, k_ready,
                      v_ready, kv_empty, turn, qk_scale, first_q, q_len, ctx, tok0, head, split, lo, hi, num_q_heads,
                      num_splits, stride_ot, stride_oh, c, tc, H: gl.constexpr, HEAD_DIM: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr, Q_REGS: gl.constexpr,
                      SPLIT: gl.constexpr):  # fmt: skip
        """One work item for warpgroup ``H``; ``c``: key tiles consumed before it (ring
        position), ``tc``: MMA turns taken before it. Key tiles are numbered by position in the
        sequence (``ctx`` cached keys, then the chunk's); the item's are [lo, hi). With ``SPLIT``
        the unnormalised output, max and sum go to the partial buffers [token, head, split, ...]
        for the merge. Returns the key tiles it used."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])  # fmt: skip
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])  # fmt: skip
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        dtype: gl.constexpr = q.dtype
        n_tiles = hi - lo
        if Q_REGS:  # Q into registers at once: the loader may fetch the next item's Q during this one
            q = q.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
            mbarrier.arrive(q_empty)
        row0 = first_q + H * _HALF
        q_pos = ctx + row0 + gl.arange(0, _HALF, layout=gl.SliceLayout(1, s_layout))
        mask_from = (ctx + row0 + 1) // BLOCK_N  # key tiles below this are visible to every row

        # the first tile: its QK^T alone
        if PINGPONG:
            mbarrier.wait(turn.index(H), tc & 1)
        mbarrier.wait(k_ready.index(c % STAGES), (c // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(c % STAGES).permute((1, 0)),
                          gl.zeros([_HALF, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)  # fmt: skip
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - H))
        s = warpgroup_mma_wait(0, deps=[s])
        m_i = gl.full([_HALF], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([_HALF], gl.float32, gl.SliceLayout(1, s_layout))
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, lo, qk_scale, q_pos, mask_from, BLOCK_N, s_layout, SPLIT)
        p_op = gl.convert_layout(p.to(dtype), p_layout)  # carried in 16 bits: P of the previous tile
        acc = gl.zeros([_HALF, HEAD_DIM], gl.float32, o_layout)
        for j in range(1, n_tiles):  # the item's j-th key tile, tile lo + j of the sequence
            st = (c + j) % STAGES
            prev = (c + j - 1) % STAGES
            if PINGPONG:
                mbarrier.wait(turn.index(H), (tc + j) & 1)
            mbarrier.wait(k_ready.index(st), ((c + j) // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), gl.zeros([_HALF, BLOCK_N], gl.float32, s_layout),
                              use_acc=False, is_async=True)  # fmt: skip
            mbarrier.wait(v_ready.index(prev), ((c + j - 1) // STAGES) & 1)
            acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - H))
            s = warpgroup_mma_wait(1, deps=[s])  # QK^T done, PV may still run
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, lo + j, qk_scale, q_pos, mask_from, BLOCK_N, s_layout,
                                          SPLIT)  # fmt: skip
            acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
            mbarrier.arrive(kv_empty.index(prev))
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        if not Q_REGS:
            mbarrier.arrive(q_empty)  # every QK^T of the item is done: the loader may refill Q
        # PV of the last tile
        last = (c + n_tiles - 1) % STAGES
        if PINGPONG:
            mbarrier.wait(turn.index(H), (tc + n_tiles) & 1)
        mbarrier.wait(v_ready.index(last), ((c + n_tiles - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - H))
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(kv_empty.index(last))

        rows = row0 + gl.arange(0, _HALF, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        if SPLIT:
            part = ((tok0 + rows).to(gl.int64) * num_q_heads + head) * num_splits + split
            gl.store(part_out_ptr + part[:, None] * HEAD_DIM + cols[None, :], acc, mask=(rows < q_len)[:, None])
            ml_rows = row0 + gl.arange(0, _HALF, layout=gl.SliceLayout(1, s_layout))
            ml_part = ((tok0 + ml_rows).to(gl.int64) * num_q_heads + head) * num_splits + split
            gl.store(part_max_ptr + ml_part, m_i, mask=ml_rows < q_len)
            gl.store(part_sum_ptr + ml_part, l_i, mask=ml_rows < q_len)
        else:
            out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
            offs = (tok0 + rows).to(gl.int64)[:, None] * stride_ot + head * stride_oh + cols[None, :]
            gl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=(rows < q_len)[:, None])
        return n_tiles

    @gluon.jit
    def _consumer(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, q_smem, k_smem, v_smem, item_smem, q_ready,
                  q_empty, k_ready, v_ready, kv_empty, turn, qk_scale, num_q_heads, num_splits, num_items, stride_ot,
                  stride_oh, H: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  PINGPONG: gl.constexpr, Q_REGS: gl.constexpr, SPLIT: gl.constexpr):  # fmt: skip
        c = 0  # key tiles consumed so far
        it = 0  # work items done so far
        mbarrier.wait(q_ready, 0)
        w, head, split, tok0, q_len, ctx, first_q, lo, hi = _read_item(item_smem)
        while w < num_items:  # the loader publishes only items with query rows and keys
            # an item takes one MMA turn per key tile plus one: c + it turns before this one
            c += _consume_item(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, q_smem.index(H), k_smem, v_smem,
                               q_empty, k_ready, v_ready, kv_empty, turn, qk_scale, first_q, q_len, ctx, tok0, head,
                               split, lo, hi, num_q_heads, num_splits, stride_ot, stride_oh, c, c + it, H, HEAD_DIM,
                               BLOCK_N, STAGES, PINGPONG, Q_REGS, SPLIT)  # fmt: skip
            it += 1
            mbarrier.wait(q_ready, it & 1)
            w, head, split, tok0, q_len, ctx, first_q, lo, hi = _read_item(item_smem)

    @gluon.jit(do_not_specialize=["num_seqs", "num_slots", "num_splits", "num_items", "stride_bt"],
               do_not_specialize_on_alignment=["cu_seqlens_ptr", "seq_lens_ptr", "tables_ptr"])
    def _prefill_gluon_kernel(q_desc, k_desc, v_desc, kc_desc, vc_desc, out_ptr, part_out_ptr, part_max_ptr,
                              part_sum_ptr, sched_ptr, cu_seqlens_ptr, seq_lens_ptr, tables_ptr, stride_bt, stride_cb,
                              stride_ch, qk_scale, num_seqs, num_slots, num_splits, num_items, stride_ot, stride_oh,
                              GROUP: gl.constexpr, NUM_Q_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr,
                              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, HAS_CACHE: gl.constexpr,
                              PAGE: gl.constexpr, ROWS: gl.constexpr, DYNAMIC: gl.constexpr, Q_REGS: gl.constexpr,
                              SPLIT: gl.constexpr):  # fmt: skip
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [2, _HALF, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        item_smem = gl.allocate_shared_memory(gl.int32, [ITEM_FIELDS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        mbarrier.init(q_empty, count=2)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        mbarrier.arrive(turn.index(0))  # warpgroup 0 issues first
        # (argument tuples are spelled out: concatenating tuples would unwrap the constexprs)
        gl.warp_specialize(
            [
                (_consumer, (out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, q_smem, k_smem, v_smem, item_smem,
                             q_ready, q_empty, k_ready, v_ready, kv_empty, turn, qk_scale, NUM_Q_HEADS, num_splits,
                             num_items, stride_ot, stride_oh, gl.constexpr(0), HEAD_DIM, BLOCK_N, STAGES, PINGPONG,
                             Q_REGS, SPLIT)),
                (_consumer, (out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, q_smem, k_smem, v_smem, item_smem,
                             q_ready, q_empty, k_ready, v_ready, kv_empty, turn, qk_scale, NUM_Q_HEADS, num_splits,
                             num_items, stride_ot, stride_oh, gl.constexpr(1), HEAD_DIM, BLOCK_N, STAGES, PINGPONG,
                             Q_REGS, SPLIT)),
                (_loader, (q_desc, k_desc, v_desc, kc_desc, vc_desc, q_smem, k_smem, v_smem, item_smem, q_ready,
                           q_empty, k_ready, v_ready, kv_empty, sched_ptr, part_max_ptr, part_sum_ptr,
                           cu_seqlens_ptr, seq_lens_ptr, tables_ptr, stride_bt, stride_cb, stride_ch, num_seqs,
                           NUM_Q_HEADS, num_slots, num_splits, num_items, GROUP, HEAD_DIM, BLOCK_N, STAGES,
                           HAS_CACHE, PAGE, ROWS, DYNAMIC, SPLIT)),
            ],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )  # fmt: skip


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _layout(rows: int, head_dim: int, bits: int):
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.float16 if bits == 16 else gl.float32)


def descriptors(q, k, v, block_n: int):
    """Host descriptors over Q, K, V viewed as [tokens, heads * head_dim]."""
    head_dim = q.shape[2]
    return tuple(TensorDescriptor(t, [t.shape[0], t.shape[1] * head_dim], [t.stride(0), 1], [rows, head_dim],
                                  _layout(rows, head_dim, 16))
                 for t, rows in ((q, HALF), (k, block_n), (v, block_n)))  # fmt: skip


def cache_supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """A paged cache [blocks, kv_heads, page, head_dim] the kernel reads page by page: q's dtype,
    pages of 8+ rows (a power of two), each head's page rows contiguous, 16-byte aligned."""
    page, head_dim = k_cache.shape[2:]
    return (k_cache.dtype == q.dtype and v_cache.dtype == q.dtype and v_cache.shape == k_cache.shape
            and v_cache.stride() == k_cache.stride() and page >= 8 and page & (page - 1) == 0
            and all(c.stride(3) == 1 and c.stride(2) == head_dim and c.stride(1) % head_dim == 0
                    and c.stride(0) % head_dim == 0 and c.data_ptr() % 16 == 0
                    for c in (k_cache, v_cache)))  # fmt: skip


def cache_rows(cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The paged cache [blocks, kv_heads, page, d] as rows of d the kernel addresses: (the flat
    [rows, d] view, rows per block, rows per KV head); (block, kv_head, slot) is row
    ``block * per_block + kv_head * per_head + slot``."""
    blocks, kv_heads, page, head_dim = cache.shape
    rows = ((blocks - 1) * cache.stride(0) + (kv_heads - 1) * cache.stride(1)) // head_dim + page
    return cache.as_strided((rows, head_dim), (head_dim, 1)), cache.stride(0) // head_dim, cache.stride(1) // head_dim


def _cache_descriptor(flat: torch.Tensor, page: int, block_n: int):
    """Boxes of one page (at most one key tile) over ``cache_rows``' view."""
    rows, head_dim = flat.shape
    return TensorDescriptor(flat, [rows, head_dim], [head_dim, 1], [min(page, block_n), head_dim],
                            _layout(block_n, head_dim, 16))  # fmt: skip


def num_splits(num_seqs: int, max_seqlen_q: int, max_seqlen_k: int, q_heads: int, num_sms: int,
               block_n: int = DEFAULT_CONFIG["block_n"]) -> int:
    """Key-range splits for a launch whose work items (at most ``num_seqs`` x query tiles of the
    longest chunk x heads) would leave half the SMs idle: short chunks over long cached prefixes
    (q=128 after 8k: 32 items of 65 key tiles for 132 SMs). Enough splits to fill the SMs once,
    each at least 4 key tiles; a merge kernel combines them."""
    items = num_seqs * -(-max_seqlen_q // BLOCK_M) * q_heads
    if 2 * items > num_sms:
        return 1
    return max(1, min(num_sms // items, max_seqlen_k // (4 * block_n)))


def prefill_attention_gluon(q, k, v, out, cu_seqlens, scale, config=None, cache=None, max_seqlen_q=None,
                            max_seqlen_k=None):  # fmt: skip
    """Causal attention of the chunks packed along tokens: ``q`` [tokens, q_heads, d],
    ``k``/``v`` [tokens, kv_heads, d] (the same tokens), ``cu_seqlens`` int32 [seqs + 1]
    (offsets from its first element), ``out`` [tokens, q_heads, d]; ``scale`` already includes log2(e).
    ``cache``: (k_cache, v_cache, seq_lens, block_tables) when chunks may follow a cached prefix
    (``seq_lens`` minus the chunk's length): its keys are read from the paged cache
    [blocks, kv_heads, page, d] (``cache_supported``); without it every sequence starts fresh.
    ``max_seqlen_q`` / ``max_seqlen_k`` (host ints: the longest chunk and the longest sequence
    with its prefix), when given with a cache, let launches of few long items split their key
    ranges (``num_splits``; ``config["splits"]`` forces a count). Returns the compiled kernel
    (for its resource report)."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    tokens, q_heads, head_dim = q.shape
    num_seqs = cu_seqlens.shape[0] - 1
    num_slots = tokens // BLOCK_M + num_seqs  # query tiles, one spare per sequence (skipped when empty)
    sms = _num_sms(q.device.index or 0)
    splits = cfg.get("splits") or 1
    if cache is not None and max_seqlen_q and max_seqlen_k and "splits" not in cfg:
        splits = num_splits(num_seqs, max_seqlen_q, max_seqlen_k, q_heads, sms, cfg["block_n"])
    num_items = num_slots * q_heads * splits
    grid = (min(num_items, sms) if cfg["persistent"] else num_items,)
    parts = split_partials(tokens, q_heads, splits, head_dim, q.device) if splits > 1 else (out, out, out)
    q_desc, k_desc, v_desc = descriptors(q, k, v, cfg["block_n"])
    if cache is None:
        paged = (k_desc, v_desc, cu_seqlens, cu_seqlens, 0, 0, 0)
        page = 16
    else:
        k_cache, v_cache, seq_lens, tables = cache
        page = k_cache.shape[2]
        (k_flat, per_block, per_head), (v_flat, *_) = cache_rows(k_cache), cache_rows(v_cache)
        paged = (_cache_descriptor(k_flat, page, cfg["block_n"]), _cache_descriptor(v_flat, page, cfg["block_n"]),
                 seq_lens, tables, tables.stride(0), per_block, per_head)  # fmt: skip
    kernel = _prefill_gluon_kernel[grid](
        q_desc, k_desc, v_desc, paged[0], paged[1], out, *parts, counters.launch_counters(q.device), cu_seqlens,
        *paged[2:], scale, num_seqs, num_slots, splits, num_items, out.stride(0), out.stride(1),
        GROUP=q_heads // k.shape[1], NUM_Q_HEADS=q_heads, HEAD_DIM=head_dim,
        BLOCK_N=cfg["block_n"], STAGES=cfg["stages"], PINGPONG=cfg["pingpong"], CONSUMER_REGS=cfg["consumer_regs"],
        LOADER_REGS=cfg["loader_regs"], HAS_CACHE=cache is not None, PAGE=page, ROWS=min(page, cfg["block_n"]),
        DYNAMIC=cfg["dynamic"], Q_REGS=cfg["q_regs"], SPLIT=splits > 1, num_warps=4,
    )  # fmt: skip
    if splits > 1:
        merge_splits(out, *parts)
    return kernel
