"""MLA kernels (Triton interpreter) against the references of ``atom.ops.mla``."""

import pytest
import torch

from atom.ops import mla as reference
from atom.ops.triton import mla_decode, mla_rope_store


def cos_sin(max_pos: int, rope_dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2).float() / rope_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * 1.1  # a yarn-like attention factor


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("num_heads, nope, rank, rope", [(4, 12, 16, 8), (20, 32, 48, 16)])
def test_mla_rope_store(num_heads, nope, rank, rope, interleaved, dtype, assert_close):
    num_tokens, block_size, num_blocks = 11, 4, 9
    q = torch.randn(num_tokens, num_heads, nope + rope, dtype=dtype)
    kv_c = torch.randn(num_tokens, rank, dtype=dtype)
    k_pe = torch.randn(num_tokens, rope, dtype=dtype)
    positions = torch.randint(0, 60, (num_tokens,))
    table = cos_sin(64, rope)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[3] = -1  # a padded row stores nothing
    cache = torch.zeros(num_blocks, block_size, rank + rope, dtype=dtype)
    ref_cache = cache.clone()
    q_out, k_out = mla_rope_store(q, kv_c, k_pe, positions, table, cache, slots, interleaved)
    q_ref, k_ref = reference.mla_rope_store(q, kv_c, k_pe, positions, table, ref_cache, slots, interleaved)
    assert_close(q_out, q_ref, dtype)
    assert_close(k_out, k_ref, dtype)
    assert_close(cache, ref_cache, dtype)
    assert_close(cache.flatten(0, 1)[slots[0]], torch.cat((kv_c[0], k_ref[0])), dtype)
    assert int((cache.flatten(0, 1).abs().sum(-1) > 0).sum()) == num_tokens - 1


def test_mla_rope_store_without_cache(assert_close):
    q, kv_c, k_pe = torch.randn(5, 3, 24), torch.randn(5, 16), torch.randn(5, 8)
    positions, table = torch.arange(5), cos_sin(8, 8)
    q_out, k_out = mla_rope_store(q, kv_c, k_pe, positions, table, None, None, True)
    q_ref, k_ref = reference.mla_rope_store(q, kv_c, k_pe, positions, table, None, None, True)
    assert_close(q_out, q_ref, torch.float32)
    assert_close(k_out, k_ref, torch.float32)


CASES = {
    # name: (context lengths, num_heads, kv_lora_rank, rope_dim, block_size)
    "b1": ([37], 4, 32, 16, 16),
    "tiny_rank": ([1, 9, 30], 3, 16, 8, 4),
    "many_heads": ([5, 70, 16, 1], 20, 64, 16, 16),
    "deepseek_dims": ([65, 3], 16, 512, 64, 32),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_mla_decode(case, dtype, assert_close):
    lens, num_heads, rank, rope, block_size = case
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks + 3
    tables = torch.randperm(num_blocks, dtype=torch.int32)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    cache = torch.randn(num_blocks, block_size, rank + rope, dtype=dtype)
    q = torch.randn(len(lens), num_heads, rank + rope, dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = 0.3 / (rank + rope) ** 0.5 * 4
    out = mla_decode(q, cache, seq_lens, tables, scale, rank)
    ref = reference.mla_decode(q.float(), cache.float(), seq_lens, tables, scale, rank)
    assert out.dtype == dtype
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("case", ["b1", "tiny_rank", "many_heads"])
def test_mla_decode_split_context(case, num_splits, assert_close):
    # Splits are picked automatically only on a GPU; force them here. Short contexts with
    # many splits leave some splits without rows, which the merge must ignore.
    dtype = torch.bfloat16
    lens, num_heads, rank, rope, block_size = CASES[case]
    max_blocks = -(-max(lens) // block_size)
    tables = torch.randperm(len(lens) * max_blocks, dtype=torch.int32).view(len(lens), max_blocks)
    cache = torch.randn(len(lens) * max_blocks, block_size, rank + rope, dtype=dtype)
    q = torch.randn(len(lens), num_heads, rank + rope, dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = mla_decode(q, cache, seq_lens, tables, 0.2, rank, num_splits=num_splits)
    ref = reference.mla_decode(q.float(), cache.float(), seq_lens, tables, 0.2, rank)
    assert_close(out, ref, dtype)
