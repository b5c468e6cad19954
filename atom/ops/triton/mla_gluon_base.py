"""What the Gluon MLA decode kernels for Hopper share (``mla_gluon.py``, 64 heads a program, and
``mla_gluon_narrow.py``, 16 or 32 heads as the MMA's N): Gluon's Hopper API when Triton has it,
DeepSeek's latent dims and the tile sizes, the TMA descriptors and split buffers a launch takes,
and a split's key range on the device."""

from __future__ import annotations

import functools

import torch

from atom.ops.triton import prefill_attention_gluon

try:  # Gluon and its Hopper module exist from Triton 3.5; the API used here is 3.6's
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = hasattr(gl, "warp_specialize") and hasattr(tma, "async_copy_global_to_shared")
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

# the same conditions as the Gluon prefill kernel's (Hopper, Gluon, not the interpreter)
available = prefill_attention_gluon.available

RANK, ROPE = 512, 64
BLOCK_N = 64  # keys per tile
COLS = 64  # columns per shared-memory chunk (128-byte swizzle rows)
CHUNKS = (RANK + ROPE) // COLS
LOG2E = 1.4426950408889634
FP8 = torch.float8_e4m3fn


@functools.cache
def smem_layout(dtype: torch.dtype = torch.bfloat16):
    """Shared-memory layout of [rows, 64] boxes of 16-bit values (128-byte swizzled rows), or of fp8
    ones (64-byte rows, as swizzled)."""
    return gl.NVMMASharedLayout.get_default_for([BLOCK_N, COLS], gl.float8e4nv if dtype == FP8 else gl.bfloat16)


def operands(q, kv_cache, splits, out, q_rows):
    """What both decode kernels take: TMA descriptors of the query (contiguous; boxes of ``q_rows``
    heads by 64 columns) and of the latent cache (16-bit or fp8; boxes of a page or 64 rows), the page
    and box rows, and the split partials' buffers (``out`` itself without splits)."""
    num_seqs, num_heads, dim = q.shape
    page = kv_cache.shape[1]
    rows = min(page, BLOCK_N)
    q_desc = TensorDescriptor(q, [num_seqs * num_heads, dim], [dim, 1], [q_rows, COLS], smem_layout())
    c_desc = TensorDescriptor(kv_cache, [kv_cache.shape[0] * page, dim], [dim, 1], [rows, COLS],
                              smem_layout(kv_cache.dtype))
    part_out = part_ml = out
    if splits > 1:
        part_out = torch.empty(num_seqs, num_heads, splits, RANK, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_seqs, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    return q_desc, c_desc, page, rows, part_out, part_ml


if HAVE_GLUON:
    _BLOCK_N = gl.constexpr(BLOCK_N)

    @gluon.jit
    def split_range(seq_lens_ptr, seq, split, num_splits):
        """The sequence's length and the keys [lo, hi) of its context split ``split`` (whole 64-key
        tiles but the last; empty past a short sequence), in ``n_tiles`` tiles."""
        seq_len = gl.load(seq_lens_ptr + seq)
        chunk = gl.cdiv(gl.cdiv(seq_len, num_splits), _BLOCK_N) * _BLOCK_N
        lo = split * chunk
        hi = gl.minimum(lo + chunk, seq_len)
        return seq_len, lo, hi, gl.cdiv(gl.maximum(hi - lo, 0), _BLOCK_N)
