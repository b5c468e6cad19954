"""MLA kernels (Triton interpreter) against the references of ``atom.ops.mla``."""

import pytest
import torch

from atom.ops import mla as reference
from atom.ops import reference as reference_ops
from atom.ops.triton import mla_decode, mla_prefill_attention, mla_rope_store


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


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_mla_rope_store_into_decode_query_tail(interleaved, norm, dtype, assert_close):
    """``q_pe_out``: only the rotated rope columns, written into the tail of a wider decode query
    (a strided view); its other columns untouched, the cache written as without it. ``kv_norm``:
    the latent normed in the kernel as ``rms_norm`` norms it (the strided latent of the
    ``kv_a_proj`` output, as the model passes it)."""
    num_tokens, num_heads, nope, rank, rope, block_size = 6, 5, 12, 16, 8, 4
    q = torch.randn(num_tokens, num_heads, nope + rope, dtype=dtype)
    kv_c, k_pe = torch.randn(num_tokens, rank + rope, dtype=dtype).split([rank, rope], dim=-1)
    kv_norm = (torch.rand(rank, dtype=dtype) + 0.5, 1e-6) if norm else None
    positions, table, slots = torch.randint(0, 60, (num_tokens,)), cos_sin(64, rope), torch.randperm(40)[:num_tokens]
    cache = torch.zeros(10, block_size, rank + rope, dtype=dtype)
    ref_cache = cache.clone()
    decode_q = torch.full((num_tokens, num_heads, rank + rope), 7.0, dtype=dtype)
    tail = decode_q[..., rank:]
    q_pe, k_out = mla_rope_store(q, kv_c, k_pe, positions, table, cache, slots, interleaved, q_pe_out=tail,
                                 kv_norm=kv_norm)  # fmt: skip
    normed = reference_ops.rms_norm(kv_c, *kv_norm) if norm else kv_c
    q_ref, k_ref = reference.mla_rope_store(q, normed, k_pe, positions, table, ref_cache, slots, interleaved)
    assert q_pe.data_ptr() == decode_q[..., rank:].data_ptr()
    assert_close(decode_q[..., rank:], q_ref[..., nope:], dtype)
    assert torch.equal(decode_q[..., :rank], torch.full_like(decode_q[..., :rank], 7.0))
    assert_close(k_out, k_ref, dtype)
    assert_close(cache, ref_cache, dtype)


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
    "odd_rank": ([3, 45, 17], 70, 40, 8, 16),  # latent columns not a power of two, heads past a 64 block
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


# FP8 latent cache (``--kv_cache_dtype fp8``): e4m3 rows divided by the layer's k_scale
FP8 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _e4m3(x: torch.Tensor, k_scale: float) -> torch.Tensor:
    """torch's own conversion: float32 division by the scale, saturated, rounded to nearest even."""
    return (x.float() / torch.tensor(k_scale)).clamp(-448, 448).to(FP8)


@pytest.mark.parametrize("k_scale", [1.0, 0.37])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("num_heads, nope, rank, rope", [(4, 12, 16, 8), (3, 8, 40, 12)])
def test_mla_rope_store_fp8_codes(num_heads, nope, rank, rope, interleaved, k_scale, dtype):
    num_tokens, block_size, num_blocks = 13, 4, 9
    q = torch.randn(num_tokens, num_heads, nope + rope, dtype=dtype)
    # latents spread over e4m3's range: some past 448 * k_scale (saturated), some subnormal
    kv_c = (torch.randn(num_tokens, rank) * torch.exp(torch.randn(num_tokens, rank) * 3)).to(dtype)
    k_pe = torch.randn(num_tokens, rope, dtype=dtype) * 200
    positions, table = torch.randint(0, 60, (num_tokens,)), cos_sin(64, rope)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[5] = -1  # a padded row stores nothing
    scale = torch.tensor([k_scale])
    cache, ref_cache = (torch.zeros(num_blocks, block_size, rank + rope, dtype=FP8) for _ in range(2))
    _, k_out = mla_rope_store(q, kv_c, k_pe, positions, table, cache, slots, interleaved, scale)
    _, k_ref = reference.mla_rope_store(q, kv_c, k_pe, positions, table, ref_cache, slots, interleaved, scale)
    keep = slots >= 0
    rows = cache.flatten(0, 1)[slots[keep]]
    # the kernel's rotated keys, quantised by torch: its RoPE against the reference's is
    # test_mla_rope_store's business (in 16 bits they may differ by an ulp)
    assert torch.equal(_bits(rows), _bits(_e4m3(torch.cat((kv_c, k_out), -1)[keep], k_scale)))
    assert torch.equal(_bits(ref_cache.flatten(0, 1)[slots[keep]]),
                       _bits(_e4m3(torch.cat((kv_c, k_ref), -1)[keep], k_scale)))  # fmt: skip
    if dtype == torch.float32:
        assert torch.equal(_bits(cache), _bits(ref_cache))
    assert rows.float().abs().max() == 448  # saturated, not NaN
    assert int((_bits(cache.flatten(0, 1)) != 0).any(-1).sum()) == num_tokens - 1


def _fp8_latents(num_blocks, block_size, width, k_scale):
    return (torch.randn(num_blocks, block_size, width) * 2 / k_scale).clamp(-448, 448).to(FP8)


@pytest.mark.parametrize("k_scale", [1.0, 0.05])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_mla_decode_fp8_cache(case, k_scale, dtype, assert_close):
    lens, num_heads, rank, rope, block_size = case
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks + 3
    tables = torch.randperm(num_blocks, dtype=torch.int32)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    cache = _fp8_latents(num_blocks, block_size, rank + rope, k_scale)
    q = torch.randn(len(lens), num_heads, rank + rope, dtype=dtype)
    seq_lens, scale = torch.tensor(lens, dtype=torch.int32), 0.3 / (rank + rope) ** 0.5
    k = torch.tensor([k_scale])
    out = mla_decode(q, cache, seq_lens, tables, scale, rank, k)
    ref = reference.mla_decode(q.float(), cache, seq_lens, tables, scale, rank, k)
    # the reference is exactly attention over the dequantised float32 cache
    assert torch.equal(ref, reference.mla_decode(q.float(), cache.float() * k, seq_lens, tables, scale, rank))
    assert out.dtype == dtype
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_mla_decode_fp8_cache_split_context(num_splits, assert_close):
    lens, num_heads, rank, rope, block_size = CASES["many_heads"]
    max_blocks = -(-max(lens) // block_size)
    tables = torch.randperm(len(lens) * max_blocks, dtype=torch.int32).view(len(lens), max_blocks)
    cache = _fp8_latents(len(lens) * max_blocks, block_size, rank + rope, 0.25)
    q = torch.randn(len(lens), num_heads, rank + rope, dtype=torch.bfloat16)
    seq_lens, k = torch.tensor(lens, dtype=torch.int32), torch.tensor([0.25])
    out = mla_decode(q, cache, seq_lens, tables, 0.1, rank, k, num_splits=num_splits)
    ref = reference.mla_decode(q.float(), cache, seq_lens, tables, 0.1, rank, k)
    assert_close(out, ref, torch.bfloat16)


def test_mla_prefill_reads_the_fp8_cache():
    """With an fp8 cache every prompt row reads the dequantised latents, this step's rows
    included (a whole prompt too), never the unquantised new rows: the result is the prefill
    over a float32 cache holding the dequantised values."""
    num_heads, nope, rope, rank, v_dim, block_size = 3, 8, 4, 16, 6, 4
    lens, q_lens = [9, 6, 13], [9, 2, 5]  # a whole prompt, then two chunks after a cached prefix
    tables = torch.randperm(12, dtype=torch.int32).view(3, 4)
    cache, k = _fp8_latents(12, block_size, rank + rope, 0.5), torch.tensor([0.5])
    deq = cache.float() * k
    slots = [int(tables[i, p // block_size]) * block_size + p % block_size
             for i, (n, m) in enumerate(zip(lens, q_lens)) for p in range(n - m, n)]  # fmt: skip
    cu = torch.tensor([0, 9, 11, 16], dtype=torch.int32)
    q = torch.randn(16, num_heads, nope + rope)
    w = torch.randn(num_heads * (nope + v_dim), rank) * 0.3
    args = (cu, torch.tensor(lens, dtype=torch.int32), tables, w, 0.2, v_dim)
    out = reference.mla_prefill(q, cache, torch.randn(16, rank + rope), *args, k)
    assert torch.equal(out, reference.mla_prefill(q, deq, deq.flatten(0, 1)[slots], *args))


@pytest.mark.parametrize("block_h, block_n, halves", [(32, 16, False), (64, 32, False), (8, 64, False),
                                                      (64, 64, True), (32, 32, True)])  # fmt: skip
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("case", ["many_heads", "odd_rank"])
def test_mla_decode_tile_configs(case, block_h, block_n, halves, fp8, monkeypatch, assert_close):
    """Other tile configs (tests/gpu/kernel_sweep.py mla): head blocks wider than the heads or
    not dividing them, row tiles across cache blocks, the latent columns as two halves, with
    context splits."""
    from atom.ops.triton import mla

    config = dict(BLOCK_H=block_h, BLOCK_N=block_n, HALVES=halves, num_warps=8, num_stages=2)
    monkeypatch.setattr(mla, "_decode_config", lambda *_: config)
    lens, num_heads, rank, rope, block_size = CASES[case]
    max_blocks = -(-max(lens) // block_size)
    tables = torch.randperm(len(lens) * max_blocks, dtype=torch.int32).view(len(lens), max_blocks)
    cache = torch.randn(len(lens) * max_blocks, block_size, rank + rope)
    k = torch.tensor([0.5]) if fp8 else None
    cache = (cache / k).to(FP8) if fp8 else cache.to(torch.bfloat16)
    q = torch.randn(len(lens), num_heads, rank + rope, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    for splits in (1, 3):
        out = mla_decode(q, cache, seq_lens, tables, 0.2, rank, k, num_splits=splits)
        assert_close(out, reference.mla_decode(q.float(), cache, seq_lens, tables, 0.2, rank, k), torch.bfloat16)


@pytest.mark.parametrize("num_heads", [128, 64, 32, 16])
@pytest.mark.parametrize("fp8", [False, True])
def test_mla_decode_deepseek_heads(num_heads, fp8, assert_close):
    """DeepSeek-V3's dims (latent 512 + rope 64) at its 128 heads and the shards of -tp 2, 4, 8, each
    with the tile config mla_decode picks for it, over odd context lengths, with and without context
    splits (the 64-head two-halves candidate: test_mla_decode_tile_configs)."""
    lens, rank, rope, block_size = [1, 37, 50], 512, 64, 16
    max_blocks = -(-max(lens) // block_size)
    tables = torch.randperm(len(lens) * max_blocks, dtype=torch.int32).view(len(lens), max_blocks)
    k = torch.tensor([0.3]) if fp8 else None
    cache = _fp8_latents(len(lens) * max_blocks, block_size, rank + rope, 0.3) if fp8 else (
        torch.randn(len(lens) * max_blocks, block_size, rank + rope, dtype=torch.bfloat16))  # fmt: skip
    q = torch.randn(len(lens), num_heads, rank + rope, dtype=torch.bfloat16)
    seq_lens, scale = torch.tensor(lens, dtype=torch.int32), 192**-0.5
    ref = reference.mla_decode(q.float(), cache, seq_lens, tables, scale, rank, k)
    for splits in (1, 4):
        out = mla_decode(q, cache, seq_lens, tables, scale, rank, k, num_splits=splits)
        assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("num_heads, nope, rope, v_dim", [(3, 8, 4, 6), (2, 32, 16, 32)])
@pytest.mark.parametrize("prefix", [False, True])
def test_mla_prefill_attention(num_heads, nope, rope, v_dim, prefix, dtype, assert_close):
    """All sequences in one launch: sequences shorter than, equal to and longer than a query
    tile, an empty one, head dims that are not powers of two; the keys' two parts (per-head
    nope, shared rope) against the reference's concatenated keys. With ``prefix`` the queries
    are the last rows of longer key sequences (chunks after earlier rows: prefixes ending
    inside and on the edge of a tile, and one with no earlier rows)."""
    q_lens = [1, 70, 0, 17, 64]
    k_lens = [1 + 40, 70 + 64, 5, 17, 64 + 130] if prefix else q_lens
    cu, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (q_lens, k_lens))
    q = torch.randn(sum(q_lens), num_heads, nope + rope, dtype=dtype)
    kv = torch.randn(sum(k_lens), num_heads, nope + v_dim, dtype=dtype)
    latents = torch.randn(sum(k_lens), 5 + rope, dtype=dtype)  # k_pe: a strided slice, as the layer passes it
    args = (q, kv, latents[:, 5:], cu, cu_k, max(q_lens), 0.3, v_dim)
    assert_close(mla_prefill_attention(*args), reference.mla_prefill_attention(*args), dtype)


def test_mla_prefill_attention_reference_offsets():
    """The reference's chunk after earlier rows is the whole sequence's attention, last rows."""
    q, kv, k_pe = torch.randn(9, 2, 12), torch.randn(9, 2, 14), torch.randn(9, 4)
    cu = torch.tensor([0, 9], dtype=torch.int32)
    whole = reference.mla_prefill_attention(q, kv, k_pe, cu, cu, 9, 0.3, 6)
    chunk = reference.mla_prefill_attention(q[6:], kv, k_pe, torch.tensor([0, 3], dtype=torch.int32), cu, 3, 0.3, 6)
    torch.testing.assert_close(chunk, whole[6:])
