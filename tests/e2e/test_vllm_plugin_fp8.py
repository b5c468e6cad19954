"""atom's vLLM attention backend with ``--kv-cache-dtype fp8``: vLLM hands a byte cache and the
layer's ``_k_scale``/``_v_scale``; the backend writes e4m3 keys/values divided by the scales and
its attention equals the reference over the dequantised cache. Runs where vLLM is importable
(the plugin's environment)."""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable here")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_fp8_kv_cache_through_the_backend(kv_cache_dtype):
    from atom.ops import reference
    from atom.plugin.vllm.attention import ATOMAttentionImpl, ATOMAttentionMetadata, split_kv_cache

    heads, kv_heads, head_size, block_size, num_blocks = 4, 2, 32, 16, 8
    impl = ATOMAttentionImpl(heads, head_size, head_size**-0.5, kv_heads, kv_cache_dtype=kv_cache_dtype)
    layer = SimpleNamespace(_k_scale=torch.tensor(0.05), _v_scale=torch.tensor(0.02))
    # two requests: 5 tokens of prefill, and a decode row after 20 cached tokens (written first)
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.zeros(num_blocks, kv_heads, block_size, 2 * head_size, dtype=torch.uint8)
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    k_all, v_all = (torch.randn(26, kv_heads, head_size, generator=gen) for _ in range(2))
    history = torch.arange(20) + 2 * block_size  # request 1's cached tokens live in blocks 2 and 3
    impl.do_kv_cache_update(layer, k_all[:20], v_all[:20], kv_cache, history)
    slots = torch.cat([torch.arange(5), torch.tensor([2 * block_size + 20])])
    impl.do_kv_cache_update(layer, k_all[20:], v_all[20:], kv_cache, slots)
    k_cache, v_cache = split_kv_cache(kv_cache.view(torch.float8_e4m3fn), head_size)
    expected_k = reference.to_cache_dtype(k_all[20:25], torch.float8_e4m3fn, layer._k_scale)
    assert torch.equal(k_cache[0, :, :5].transpose(0, 1).view(torch.uint8), expected_k.view(torch.uint8))

    q = torch.randn(6, heads, head_size, generator=gen)
    meta = ATOMAttentionMetadata(num_actual_tokens=6, max_query_len=5, max_seq_len=21,
                                 query_start_loc=torch.tensor([0, 5, 6], dtype=torch.int32),
                                 seq_lens=torch.tensor([5, 21], dtype=torch.int32), block_table=block_table,
                                 slot_mapping=slots)
    out = impl.forward(layer, q, None, None, kv_cache, meta, torch.empty(6, heads, head_size))
    k_deq, v_deq = k_cache.float() * layer._k_scale, v_cache.float() * layer._v_scale
    ref = reference.paged_attention(q, k_deq, v_deq, meta.query_start_loc, meta.seq_lens, block_table,
                                    head_size**-0.5)
    assert torch.allclose(out.view(6, heads, head_size), ref, atol=1e-5)
