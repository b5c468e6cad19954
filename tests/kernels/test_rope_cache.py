import pytest
import torch

from atom.ops import reference
from atom.ops.triton import qk_norm_rope_store, rotary_embedding, store_kv_cache


def cos_sin_cache(head_dim: int, max_pos: int = 512) -> torch.Tensor:
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def fused_qkv(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype):
    """q, k, v as strided views of one projection output, the way attention layers split it."""
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (
        q.view(num_tokens, num_q_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


def test_rotary_embedding(dtype, assert_close):
    q, k, _ = fused_qkv(9, 4, 2, 64, dtype)
    positions = torch.randint(0, 512, (9,))
    cache = cos_sin_cache(64)
    out_q, out_k = rotary_embedding(positions, q, k, cache)
    ref_q, ref_k = reference.rotary_embedding(positions, q, k, cache)
    assert_close(out_q, ref_q, dtype, scale=4)
    assert_close(out_k, ref_k, dtype, scale=4)


@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_cache(block_size, dtype):
    num_tokens, num_kv_heads, head_dim, num_blocks = 11, 2, 64, 4
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype)
    k_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[2, 7]] = -1  # padded rows are not stored
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_cache(k, v, k_cache, v_cache, slots)
    reference.store_kv_cache(k, v, ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, block_size, qk_norm",
    [(4, 2, 64, 16, True), (8, 2, 128, 32, True), (4, 4, 128, 16, False), (16, 8, 64, 32, False),
     (6, 2, 96, 16, True), (4, 2, 24, 16, False)],  # head_dims that are not powers of two too
)
def test_qk_norm_rope_store(num_q_heads, num_kv_heads, head_dim, block_size, qk_norm, dtype, assert_close):
    num_tokens, num_blocks = 13, 3
    q, k, v = fused_qkv(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype)
    q_w = 1 + 0.1 * torch.randn(head_dim, dtype=dtype) if qk_norm else None
    k_w = 1 + 0.1 * torch.randn(head_dim, dtype=dtype) if qk_norm else None
    positions = torch.randint(0, 512, (num_tokens,))
    cache = cos_sin_cache(head_dim)
    k_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[0] = -1
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()

    out_q, out_k = qk_norm_rope_store(q, k, v, q_w, k_w, 1e-6, positions, cache, k_cache, v_cache, slots)
    ref_q, ref_k = reference.qk_norm_rope_store(
        q, k, v, q_w, k_w, 1e-6, positions, cache, ref_k_cache, ref_v_cache, slots
    )
    # The kernel rounds once where the reference rounds after each op.
    assert_close(out_q, ref_q, dtype, scale=8)
    assert_close(out_k, ref_k, dtype, scale=8)
    assert_close(k_cache, ref_k_cache, dtype, scale=8)
    assert torch.equal(v_cache, ref_v_cache)


@pytest.mark.parametrize("k_cache", [None, torch.empty(0)])
def test_qk_norm_rope_without_cache(k_cache, assert_close):
    # Profiling runs pass no (or an empty) cache: only q and k are produced.
    q, k, v = fused_qkv(5, 4, 2, 64, torch.float32)
    w = torch.randn(64)
    positions = torch.arange(5)
    cache = cos_sin_cache(64)
    out = qk_norm_rope_store(q, k, v, w, w, 1e-6, positions, cache, k_cache, k_cache, None)
    ref = reference.qk_norm_rope_store(q, k, v, w, w, 1e-6, positions, cache, None, None, None)
    assert_close(out[0], ref[0], torch.float32)
    assert_close(out[1], ref[1], torch.float32)
