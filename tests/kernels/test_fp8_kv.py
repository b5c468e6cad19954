"""FP8 KV cache: the fused RoPE + cache write quantises like the reference (bit for bit), and
the attention kernels over an fp8 cache match the reference that dequantises it."""

import pytest
import torch
from test_attention import CASES, make_batch

from atom.ops import reference
from atom.ops.triton import paged_attention
from atom.ops.triton.rope_cache import qk_norm_rope_store, store_kv_cache

FP8 = torch.float8_e4m3fn


def _scales(k_scale: float, v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([k_scale]), torch.tensor([v_scale])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.37, 2.5)])
def test_store_kv_cache_fp8_bits(k_scale, v_scale, dtype):
    # Values spread over the e4m3 range, some past 448 (saturated) and some subnormal.
    num_tokens, heads, head_dim, block_size, num_blocks = 11, 3, 40, 16, 4
    k = (torch.randn(num_tokens, heads, head_dim) * torch.exp(torch.randn(num_tokens, heads, head_dim) * 3)).to(dtype)
    v = torch.randn(num_tokens, heads, head_dim, dtype=dtype) * 300
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[3] = -1
    scales = _scales(k_scale, v_scale)
    caches = [torch.zeros(num_blocks, heads, block_size, head_dim, dtype=FP8) for _ in range(4)]
    store_kv_cache(k, v, caches[0], caches[1], slots, *scales)
    reference.store_kv_cache(k, v, caches[2], caches[3], slots, *scales)
    assert torch.equal(_bits(caches[0]), _bits(caches[2]))
    assert torch.equal(_bits(caches[1]), _bits(caches[3]))
    assert caches[0].float().abs().max() == 448.0  # saturated, not NaN


@pytest.mark.parametrize("block_size, width", [(16, 576), (1, 40)])
def test_store_kv_cache_fp8_latent_rows(block_size, width, dtype):
    # The vLLM plugin's MLA write (atom/plugin/vllm/mla.py): one latent row per token as key and
    # value at once, into one [num_blocks, 1, block_size, kv_lora_rank + rope] e4m3 cache.
    num_tokens, num_blocks = 21, 24
    rows = (torch.randn(num_tokens, 1, width) * 30).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[5] = -1
    scale = torch.tensor([0.37])
    out, expected = (torch.zeros(num_blocks, block_size, width, dtype=FP8).unsqueeze(1) for _ in range(2))
    store_kv_cache(rows, rows, out, out, slots, scale, scale)
    reference.store_kv_cache(rows, rows, expected, expected, slots, scale, scale)
    assert torch.equal(_bits(out), _bits(expected))
    assert int((_bits(out) != 0).sum()) > 0


@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_norm_rope_store_fp8_bits(qk_norm, dtype):
    num_tokens, hq, hk, head_dim, block_size = 9, 4, 2, 64, 16
    q = torch.randn(num_tokens, hq, head_dim, dtype=dtype) * 4
    k = torch.randn(num_tokens, hk, head_dim, dtype=dtype) * 4
    v = torch.randn(num_tokens, hk, head_dim, dtype=dtype) * 4
    qw = torch.rand(head_dim, dtype=dtype) + 0.5 if qk_norm else None
    kw = torch.rand(head_dim, dtype=dtype) + 0.5 if qk_norm else None
    positions = torch.randint(0, 100, (num_tokens,))
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(128).float()[:, None] * inv[None, :]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    slots = torch.randperm(4 * block_size)[:num_tokens]
    scales = _scales(0.05, 0.11)
    caches = [torch.zeros(4, hk, block_size, head_dim, dtype=FP8) for _ in range(4)]
    args = (qw, kw, 1e-6, positions, cos_sin)
    _, k_out = qk_norm_rope_store(q, k, v, *args, caches[0], caches[1], slots, *scales)
    reference.qk_norm_rope_store(q, k, v, *args, caches[2], caches[3], slots, *scales)
    assert torch.equal(_bits(caches[1]), _bits(caches[3]))
    # The cache holds the kernel's own rotated keys quantised as the reference does (its RoPE
    # against the reference's is the rope tests' business: in 16 bits they differ by an ulp).
    expected = [torch.zeros_like(caches[0]) for _ in range(2)]
    reference.store_kv_cache(k_out, v, *expected, slots, *scales)
    assert torch.equal(_bits(caches[0]), _bits(expected[0]))
    if dtype == torch.float32:
        assert torch.equal(_bits(caches[0]), _bits(caches[2]))


def _fp8_batch(case, dtype, k_scale, v_scale):
    q, k_cache, v_cache, cu, seq_lens, tables = make_batch(*case, dtype)
    k_fp8 = (k_cache.float() * 3 / k_scale).clamp(-448, 448).to(FP8)
    v_fp8 = (v_cache.float() * 3 / v_scale).clamp(-448, 448).to(FP8)
    return q, k_fp8, v_fp8, cu, seq_lens, tables


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_paged_attention_fp8_cache(case, dtype, assert_close):
    scales = _scales(0.02, 0.03)
    q, k_fp8, v_fp8, cu, seq_lens, tables = _fp8_batch(case, dtype, 0.02, 0.03)
    scale = case[4] ** -0.5
    out = paged_attention(q, k_fp8, v_fp8, cu, seq_lens, tables, scale, None, None, 0, None, None, *scales)
    # The reference dequantises in float32: exactly the attention over the dequantised cache.
    ref = reference.paged_attention(q.float(), k_fp8, v_fp8, cu, seq_lens, tables, scale, k_scale=scales[0],
                                    v_scale=scales[1])
    k_deq, v_deq = k_fp8.float() * scales[0], v_fp8.float() * scales[1]
    assert torch.equal(ref, reference.paged_attention(q.float(), k_deq, v_deq, cu, seq_lens, tables, scale))
    assert out.dtype == dtype
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_attention_fp8_split_and_decode_first(num_splits, assert_close):
    dtype = torch.float32
    scales = _scales(0.5, 0.25)
    q, k_fp8, v_fp8, cu, seq_lens, tables = _fp8_batch(CASES["decode_gqa4"], dtype, 0.5, 0.25)
    out = paged_attention(q, k_fp8, v_fp8, cu, seq_lens, tables, 0.1, None, None, 0, None, None, *scales,
                          num_splits=num_splits)
    ref = reference.paged_attention(q, k_fp8, v_fp8, cu, seq_lens, tables, 0.1, k_scale=scales[0], v_scale=scales[1])
    assert_close(out, ref, dtype)
    q, k_fp8, v_fp8, cu, seq_lens, tables = _fp8_batch(([1, 1, 40], [20, 70, 9], 8, 2, 64, 16), dtype, 0.5, 0.25)
    # packed k/v are ignored with an fp8 cache (they hold the unquantised values)
    junk = torch.randn(int(cu[-1]), 2, 64)
    out = paged_attention(q, k_fp8, v_fp8, cu, seq_lens, tables, 0.1, None, None, 2, junk, junk, *scales)
    ref = reference.paged_attention(q, k_fp8, v_fp8, cu, seq_lens, tables, 0.1, k_scale=scales[0], v_scale=scales[1])
    assert_close(out, ref, dtype)
