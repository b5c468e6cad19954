import pytest
import torch

from atom.ops import reference
from atom.ops.triton import paged_attention


def make_batch(q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    """Random queries and a paged cache whose blocks are scattered in a larger pool.
    Sequence i has context_lens[i] cached tokens followed by q_lens[i] new ones."""
    seq_lens = torch.tensor([c + q for c, q in zip(context_lens, q_lens)], dtype=torch.int32)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    num_blocks = len(q_lens) * max_blocks + 5
    block_tables = torch.randperm(num_blocks, dtype=torch.int32)[: len(q_lens) * max_blocks]
    block_tables = block_tables.view(len(q_lens), max_blocks)
    k_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    cu_seqlens_q = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(cu_seqlens_q[-1]), num_q_heads, head_dim, dtype=dtype)
    return q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables


CASES = {
    # name: (q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size)
    "decode_b1": ([1], [37], 4, 4, 64, 16),
    "decode_gqa4": ([1, 1, 1, 1], [0, 15, 16, 100], 8, 2, 128, 16),
    "decode_gqa2_bs32": ([1, 1, 1], [31, 32, 77], 4, 2, 64, 32),
    # 8 query heads a KV head: 128 keys a step (one partial, one past a step's end)
    "decode_gqa8": ([1, 1, 1], [0, 127, 300], 8, 1, 128, 16),
    "prefill_b1": ([45], [0], 4, 2, 64, 16),
    "prefill_gqa4": ([20, 33], [0, 0], 8, 2, 64, 32),
    "prefill_prefix_cached": ([17, 40], [48, 13], 4, 1, 128, 16),
    "mixed": ([1, 23, 1, 5], [60, 10, 3, 0], 8, 4, 64, 16),
    # short query rows at 8 query heads a KV head: two tokens a tile, 128 keys a step
    "mixed_gqa8": ([1, 5, 1, 3], [130, 20, 0, 250], 8, 1, 128, 16),
    "mixed_gqa4_bs32": ([30, 1, 1], [33, 90, 0], 8, 2, 128, 32),
    "empty_query_row": ([3, 0, 1], [5, 9, 20], 4, 2, 64, 16),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_paged_attention(case, dtype, assert_close):
    q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size = case
    q, k_cache, v_cache, cu, seq_lens, tables = make_batch(
        q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    out = paged_attention(q, k_cache, v_cache, cu, seq_lens, tables, scale)
    ref = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), cu, seq_lens, tables, scale)
    assert out.dtype == dtype
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("case", ["decode_gqa4", "decode_gqa2_bs32", "decode_gqa8", "mixed"])
def test_paged_attention_split_k(case, num_splits, assert_close):
    # Split-K is picked automatically only on a GPU; force it here. Short contexts with
    # many splits leave some splits without keys, which the merge must ignore.
    dtype = torch.bfloat16
    q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size = CASES[case]
    q, k_cache, v_cache, cu, seq_lens, tables = make_batch(
        q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    out = paged_attention(q, k_cache, v_cache, cu, seq_lens, tables, scale, num_splits=num_splits)
    ref = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), cu, seq_lens, tables, scale)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("kv_heads, tile", [(2, 64), (1, 128)], ids=["gqa4", "gqa8"])
def test_paged_attention_balance_splits(kv_heads, tile, monkeypatch, assert_close):
    # Up to 8 splits of at least two of the decode kernel's tiles (64 keys at 4 query heads a KV head,
    # 128 at 8) over uneven contexts: the 5-tile sequence takes 3 splits (tiles 2 + 2 + 1, where 8 even
    # splits would give it 5 of one tile), the one of a tile and a part tile 1, the short one 1; the rest
    # are empty and must not reach the merge.
    from atom.ops.triton import attention

    monkeypatch.setattr(attention, "_num_splits", lambda *_: (8, 2 * tile))
    dtype = torch.bfloat16
    contexts = [5 * tile - 21, tile + 5, 19]
    q, k_cache, v_cache, cu, seq_lens, tables = make_batch([1, 1, 1], contexts, 8, kv_heads, 128, 16, dtype)
    assert attention._config(128, 8 // kv_heads, 1, 2)["block_n"] == tile
    out = paged_attention(q, k_cache, v_cache, cu, seq_lens, tables, 128**-0.5, 1, 5 * tile)
    ref = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), cu, seq_lens, tables, 128**-0.5)
    assert_close(out, ref, dtype)


def test_num_splits_policy(monkeypatch):
    # filling the GPU first (splits of >= 32 keys), then balance splits for large batches when enabled
    from types import SimpleNamespace

    from atom.ops.triton import attention

    monkeypatch.setattr(attention, "_num_sms", lambda _: 132)
    q = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))  # all the policy reads of the queries
    assert attention._num_splits(q, 1, 8, 1, 4096) == (64, 0)
    assert attention._num_splits(q, 32, 8, 1, 4096) == (2, 0)
    assert attention._num_splits(q, 256, 4, 2, 4096) == (1, 0)  # prefill rows: never split here
    monkeypatch.setattr(attention, "BALANCE_SPLITS", 1)
    assert attention._num_splits(q, 256, 4, 1, 4096) == (1, 0)
    monkeypatch.setattr(attention, "BALANCE_SPLITS", 8)
    monkeypatch.setattr(attention, "SPLIT_MIN_KEYS", 512)
    assert attention._num_splits(q, 256, 4, 1, 4096) == (8, 512)
    assert attention._num_splits(q, 256, 4, 1, 3000) == (4, 512)  # 5 splits of 512 fit: a power of two
    assert attention._num_splits(q, 256, 4, 1, 600) == (1, 0)
    assert attention._num_splits(q, 32, 8, 1, 4096) == (2, 0)  # the GPU-filling split first


def test_merge_reads_no_output_row_of_an_empty_split():
    # A split that saw no key stores only its -inf max and zero sum; its output rows stay as
    # they were (NaN here) and must not reach the result.
    from atom.ops.triton.attention_merge import merge_splits

    tokens, heads, splits, head_dim = 2, 3, 5, 64
    part_out = torch.randn(tokens, heads, splits, head_dim)
    part_max, part_sum = torch.randn(tokens, heads, splits), torch.rand(tokens, heads, splits) + 0.5
    empty = torch.rand(tokens, heads, splits) < 0.5
    empty[..., 0] = False  # every row saw some key
    part_out[empty], part_max[empty], part_sum[empty] = float("nan"), float("-inf"), 0.0
    out = torch.empty(tokens, heads, head_dim)
    merge_splits(out, part_out, part_max, part_sum)
    w = torch.exp2(part_max - part_max.amax(-1, keepdim=True))
    expect = (part_out.nan_to_num() * w[..., None]).sum(2) / (part_sum * w).sum(-1, keepdim=True)
    torch.testing.assert_close(out, expect)


@pytest.mark.parametrize(
    "q_lens, context_lens",
    [([1, 1, 40], [20, 70, 9]), ([1, 33, 1, 50], [5, 0, 0, 30]), ([1, 1, 1, 2], [16, 31, 2, 60])],
)
def test_paged_attention_decode_first(q_lens, context_lens, dtype, assert_close):
    # Mixed batches with their decode rows first run as a decode launch plus a prefill
    # launch over the rest of the batch.
    num_decodes = next(i for i, n in enumerate(q_lens) if n > 1)
    q, k_cache, v_cache, cu, seq_lens, tables = make_batch(q_lens, context_lens, 8, 2, 64, 16, dtype)
    out = paged_attention(q, k_cache, v_cache, cu, seq_lens, tables, 0.125, num_decode_tokens=num_decodes)
    ref = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), cu, seq_lens, tables, 0.125)
    assert_close(out, ref, dtype)


def test_paged_attention_head_dim_256(assert_close):
    dtype = torch.bfloat16
    q, k_cache, v_cache, cu, seq_lens, tables = make_batch([1, 9], [70, 20], 4, 2, 256, 16, dtype)
    out = paged_attention(q, k_cache, v_cache, cu, seq_lens, tables, 0.0625)
    ref = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), cu, seq_lens, tables, 0.0625)
    assert_close(out, ref, dtype)


PREFILL_CONFIGS = {
    # The prefill kernel's tile shapes: rows (query tokens x padded GQA group), keys, warps, stages.
    "m128_n64": dict(block_m=128, block_n=64, num_warps=8, num_stages=2),
    "m64_n64": dict(block_m=64, block_n=64, num_warps=4, num_stages=3),
    "m64_n16": dict(block_m=64, block_n=16, num_warps=4, num_stages=1),
    # the key range cut into segments (split-K), merged afterwards
    "m64_n16_split3": dict(block_m=64, block_n=16, num_warps=4, num_stages=1, splits=3),
    "m128_n32_split2": dict(block_m=128, block_n=32, num_warps=8, num_stages=2, splits=2),
}


@pytest.mark.parametrize("config", PREFILL_CONFIGS.values(), ids=PREFILL_CONFIGS.keys())
@pytest.mark.parametrize(
    "q_lens, context_lens, num_q_heads, num_kv_heads",
    [
        # Chunk and prefix lengths on both sides of the key-tile and query-tile boundaries, so
        # the unmasked loop runs zero, one and several tiles and the diagonal spans two.
        ([63, 64, 65, 1, 17], [0, 64, 63, 129, 128], 8, 2),
        ([130, 40], [191, 0], 6, 2),  # GQA group of 3, padded to 4 rows
        ([70, 3], [1, 200], 4, 4),  # no GQA: 64 query tokens per 64-row tile
    ],
)
@pytest.mark.parametrize("packed_kv", [False, True], ids=["paged", "packed"])
def test_prefill_kernel_tiles(q_lens, context_lens, num_q_heads, num_kv_heads, config, packed_kv, assert_close):
    from atom.ops.triton.prefill_attention import prefill_attention

    dtype = torch.bfloat16
    q, k_cache, v_cache, cu, seq_lens, tables = make_batch(
        q_lens, context_lens, num_q_heads, num_kv_heads, 64, 16, dtype
    )
    kv = {}
    if packed_kv:  # the chunk's own K/V as the engine has them before they are cached
        pos = torch.cat([torch.arange(c, c + n) for c, n in zip(context_lens, q_lens)])
        seq = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
        slots = tables[seq, pos // 16].long()
        kv = {name: cache[slots, :, pos % 16] for name, cache in (("k", k_cache), ("v", v_cache))}
    out = torch.full_like(q, float("nan"))  # every element must be written
    prefill_attention(q, out, k_cache, v_cache, cu, seq_lens, tables, 0.125 * 1.4426950408889634, config, **kv)
    ref = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), cu, seq_lens, tables, 0.125)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "qkv_views"])
def test_paged_attention_packed_kv(strided, assert_close):
    # Decode rows first, then chunks: the chunks' own K/V may also be passed packed (sliced
    # past the decode rows); as views into a fused qkv buffer they must give the same result.
    q_lens, context_lens = [1, 1, 300, 70], [30, 5, 0, 33]
    q, k_cache, v_cache, cu, seq_lens, tables = make_batch(q_lens, context_lens, 8, 2, 64, 16, torch.bfloat16)
    pos = torch.cat([torch.arange(c, c + n) for c, n in zip(context_lens, q_lens)])
    seq = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    slots = tables[seq, pos // 16].long()
    k, v = k_cache[slots, :, pos % 16], v_cache[slots, :, pos % 16]
    if strided:
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
        q, k, v = (t.view(-1, h, 64) for t, h in zip(qkv.split([512, 128, 128], dim=1), (8, 2, 2)))
    out = paged_attention(q, k_cache, v_cache, cu, seq_lens, tables, 0.125, num_decode_tokens=2, k=k, v=v)
    ref = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), cu, seq_lens, tables, 0.125)
    assert_close(out, ref, torch.bfloat16)


def test_prefill_config_splits_long_keys_only():
    # Split-K (128-row tiles, two key segments) only where too few 128-row tiles face a long
    # key range: q=512 after 4096 cached at Qwen3-8B heads on 132 SMs is ~1 tile per SM.
    from atom.ops.triton.prefill_attention import prefill_config

    assert prefill_config(128, 4, 2, 1.03, True, 4608).get("splits") == 2
    assert "splits" not in prefill_config(128, 4, 2, 1.03, True, 512)  # fresh short prompt
    assert "splits" not in prefill_config(128, 4, 2, 1.03, True, 0)  # key range unknown
    assert "splits" not in prefill_config(128, 4, 2, 4.0, True, 8192)  # enough tiles


@pytest.mark.parametrize("head_dim", [24, 48, 80, 96])
@pytest.mark.parametrize(
    "q_lens, context_lens, num_splits, config",
    [
        ([1, 1, 1], [7, 40, 100], None, None),  # decode launch
        ([1, 1, 1], [7, 40, 100], 3, None),  # decode with split-K and the merge kernel
        ([1, 30, 1, 70], [20, 0, 9, 33], None, None),  # mixed: decode launch + small-tile prefill
        ([150, 70], [0, 40], None, dict(block_m=64, block_n=32, num_warps=4, num_stages=1)),  # prefill kernel
        ([70, 40], [90, 0], None, dict(block_m=64, block_n=16, num_warps=4, num_stages=1, splits=2)),  # + merge
    ],
    ids=["decode", "decode_split3", "mixed", "prefill", "prefill_split2"],
)
def test_head_dim_not_a_power_of_two(head_dim, q_lens, context_lens, num_splits, config, assert_close):
    """Models whose head_dim is not a power of two (Triton's blocks are): tiles padded to the
    next one with the padding columns masked, in every launch; the packed K/V offered with them
    are not read through descriptors (whose blocks are powers of two) but give the same result."""
    from atom.ops.triton.prefill_attention import prefill_attention

    dtype = torch.bfloat16
    q, k_cache, v_cache, cu, seq_lens, tables = make_batch(q_lens, context_lens, 6, 2, head_dim, 16, dtype)
    scale = head_dim**-0.5
    ref = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), cu, seq_lens, tables, scale)
    pos = torch.cat([torch.arange(c, c + n) for c, n in zip(context_lens, q_lens)])
    seq = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    slots = tables[seq, pos // 16].long()
    k, v = k_cache[slots, :, pos % 16], v_cache[slots, :, pos % 16]
    if config is None:
        decodes = next((i for i, n in enumerate(q_lens) if n > 1), len(q_lens))
        out = paged_attention(q, k_cache, v_cache, cu, seq_lens, tables, scale, num_decode_tokens=decodes,
                              num_splits=num_splits, k=k, v=v)  # fmt: skip
    else:
        out = torch.full_like(q, float("nan"))  # every element must be written, none past head_dim
        prefill_attention(q, out, k_cache, v_cache, cu, seq_lens, tables, scale * 1.4426950408889634, config, k=k,
                          v=v)  # fmt: skip
    assert_close(out, ref, dtype)
