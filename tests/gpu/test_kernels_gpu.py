"""Triton kernels vs the PyTorch reference at real model shapes, on CUDA.

Run in its own pytest process (``pytest tests/gpu``): tests/kernels switches Triton to its
CPU interpreter for the whole process.

Tolerances: max abs error against the reference (run in float32 on the same inputs for
attention and MoE), per unit of the output's largest magnitude (at least 1): bf16 2e-2
(a few bf16 ulps; attention and MoE accumulate in float32 but round P / intermediate
activations to bf16 like the model does), fp16 4e-3, fp32 1e-4 (float32 attention and MoE
use 3-pass tf32 dots, accurate to about float32).
"""

import os

import pytest
import torch

from atom.ops import reference
from atom.testing.sampling_checks import rounding_sensitive

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton", allow_module_level=True)

from atom.ops import triton as tk  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}
DEV = "cuda"


def assert_close(out, ref, dtype, scale=1.0):
    assert out.shape == ref.shape
    assert not out.isnan().any()
    err = (out.double() - ref.double()).abs().max().item()
    magnitude = max(1.0, ref.abs().max().item())
    assert err <= TOLERANCE[dtype] * scale * magnitude, f"max abs error {err} at magnitude {magnitude}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))


# --- attention -------------------------------------------------------------------------

MODELS = {
    # name: (num_q_heads, num_kv_heads, head_dim)
    "qwen3_8b": (32, 8, 128),
    "qwen3_0.6b": (16, 8, 128),
    "qwen3_30b_a3b": (32, 4, 128),  # 8 query heads a KV head: the 128-key decode tile
    "d64_mha": (16, 16, 64),
    "d256_gqa2": (8, 4, 256),
    # head_dims that are not powers of two: tiles padded to the next one, padding masked
    "d96_gqa4": (32, 8, 96),
    "d80_mha": (8, 8, 80),
}

BATCHES = {
    # name: (q_lens, context_lens) for a batch of sequences
    "decode_b1_8k": lambda: ([1], [8191]),
    "decode_b1_300": lambda: ([1], [300]),
    "decode_b8_3k": lambda: ([1] * 8, torch.randint(1, 3000, (8,)).tolist()),
    "decode_b512": lambda: ([1] * 512, torch.randint(1, 2048, (512,)).tolist()),
    "prefill_b1_4k": lambda: ([4096], [0]),
    "prefill_chunk_prefix": lambda: ([1024, 512], [3000, 7000]),
    "prefill_tile_edges": lambda: ([127, 128, 129, 2049, 1], [0, 4096, 255, 1, 64]),
    "mixed": lambda: ([700] + [1] * 100, [1500] + torch.randint(1, 4000, (100,)).tolist()),
}


def make_batch(q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    seq_lens = torch.tensor([c + q for c, q in zip(context_lens, q_lens)], dtype=torch.int32)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    num_blocks = len(q_lens) * max_blocks + 7
    tables = torch.randperm(num_blocks, dtype=torch.int32)[: len(q_lens) * max_blocks].view(len(q_lens), -1)
    k_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=DEV)
    v_cache = torch.randn_like(k_cache)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(cu[-1]), num_q_heads, head_dim, dtype=dtype, device=DEV)
    return q, k_cache, v_cache, cu.to(DEV), seq_lens.to(DEV), tables.contiguous().to(DEV)


def packed_kv(args, q_lens, context_lens):
    """The batch's new keys and values [tokens, kv_heads, head_dim] as the attention layer passes
    them (the same values the cache holds for them)."""
    _, k_cache, v_cache, _, _, tables = args
    block = k_cache.shape[2]
    pos = torch.cat([torch.arange(c, c + n) for c, n in zip(context_lens, q_lens)]).to(DEV)
    seq = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens)).to(DEV)
    slots = tables[seq, pos // block].long()
    return k_cache[slots, :, pos % block], v_cache[slots, :, pos % block]


def reference_attention(q, k_cache, v_cache, cu, seq_lens, tables, scale):
    return reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), cu, seq_lens, tables, scale)


CASES = [(model, batch, 16) for model in MODELS for batch in BATCHES] + [("qwen3_8b", batch, 32) for batch in BATCHES]


@pytest.mark.parametrize("model, batch, block_size", CASES)
def test_paged_attention(model, batch, block_size):
    dtype = torch.bfloat16
    q_lens, context_lens = BATCHES[batch]()
    args = make_batch(q_lens, context_lens, *MODELS[model], block_size, dtype)
    scale = MODELS[model][2] ** -0.5
    out = tk.paged_attention(*args, scale)
    assert_close(out, reference_attention(*args, scale), dtype)


@pytest.mark.parametrize("model", ["qwen3_8b", "d256_gqa2"])
def test_paged_attention_decode_first(model):
    # Decode rows placed first get their own launch with decode tiles.
    q_lens = [1] * 100 + [700, 1000]
    context_lens = torch.randint(1, 4000, (100,)).tolist() + [1500, 0]
    args = make_batch(q_lens, context_lens, *MODELS[model], 16, torch.bfloat16)
    scale = MODELS[model][2] ** -0.5
    out = tk.paged_attention(*args, scale, 1000, 5500, num_decode_tokens=100)
    assert_close(out, reference_attention(*args, scale), torch.bfloat16)


@pytest.mark.parametrize("model", ["qwen3_8b", "qwen3_0.6b"])
def test_paged_attention_packed_kv(model):
    # Decode rows, then a fresh prompt and a chunk after a cached prefix, with the chunks' own
    # K/V also passed packed (read through tensor descriptors).
    q_lens = [1] * 10 + [2049, 300]
    context_lens = torch.randint(1, 4000, (10,)).tolist() + [0, 1500]
    args = make_batch(q_lens, context_lens, *MODELS[model], 16, torch.bfloat16)
    k, v = packed_kv(args, q_lens, context_lens)
    out = tk.paged_attention(*args, 128**-0.5, 2049, 2049, num_decode_tokens=10, k=k, v=v)
    assert_close(out, reference_attention(*args, 128**-0.5), torch.bfloat16)


GLUON_BATCHES = {
    # (q_lens, context_lens): chunks over cached prefixes that end mid-tile, mid-page and on a
    # tile edge; a chunk ending in its prefix's last key tile; decode rows first (own launch)
    "fresh_and_prefix": ([4096, 200, 1000], [0, 3000, 128]),
    "tile_edges": ([127, 128, 129, 2049, 300], [0, 4096, 255, 1, 17]),
    "short_after_long": ([130, 129], [8000, 70]),
    "decode_first": ([1] * 20 + [700, 1000], [*range(100, 4000, 195), 1500, 0]),
    # few work items over long prefixes: key ranges split over programs and merged (at 16 heads
    # the second has splits with no key tile for its 3-row chunk)
    "chunk_after_long_prefix": ([128], [6000]),
    "splits_with_empty": ([136, 3], [9000, 40]),
}


@pytest.mark.parametrize("block_size", [8, 16, 64, 256])
@pytest.mark.parametrize("batch", GLUON_BATCHES)
@pytest.mark.parametrize("model", ["qwen3_8b", "qwen3_0.6b", "d64_mha"])
def test_paged_attention_gluon_prefill(model, batch, block_size, monkeypatch):
    # On Hopper, prefill chunks with their K/V packed run the Gluon kernel, the cached prefix
    # read page by page from the cache (pages of 8 to 256 rows: below, at and above a key tile)
    from atom.ops.triton import attention, prefill_attention_gluon

    if not attention._gluon_prefill(torch.device(DEV)):
        pytest.skip("the Gluon prefill kernel needs an sm_90 GPU and Triton with Gluon")
    calls = []
    real = prefill_attention_gluon.prefill_attention_gluon
    monkeypatch.setattr(prefill_attention_gluon, "prefill_attention_gluon",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))  # fmt: skip
    # split partials start as NaN (they are torch.empty): a value the kernel should have written
    # and did not (an empty split's max or sum) reaches the output
    real_parts = prefill_attention_gluon.split_partials
    monkeypatch.setattr(prefill_attention_gluon, "split_partials",
                        lambda *a: tuple(t.fill_(float("nan")) for t in real_parts(*a)))  # fmt: skip
    q_lens, context_lens = GLUON_BATCHES[batch]
    args = make_batch(q_lens, context_lens, *MODELS[model], block_size, torch.bfloat16)
    k, v = packed_kv(args, q_lens, context_lens)
    scale, max_k = MODELS[model][2] ** -0.5, max(c + n for c, n in zip(context_lens, q_lens))
    out = tk.paged_attention(*args, scale, max(q_lens), max_k, num_decode_tokens=q_lens.count(1), k=k, v=v)
    assert calls, "the batch did not reach the Gluon kernel"
    assert_close(out, reference_attention(*args, scale), torch.bfloat16)


PREFILL_VARIANTS = {
    # split-K prefill configs beside the default pick (see tests/gpu/prefill_sweep.py)
    "split2_m128": dict(block_m=128, block_n=64, num_warps=8, num_stages=2, maxnreg=128, splits=2),
    "split3_m64": dict(block_m=64, block_n=64, num_warps=4, num_stages=3, splits=3),
}


@pytest.mark.parametrize("config", PREFILL_VARIANTS.values(), ids=PREFILL_VARIANTS.keys())
@pytest.mark.parametrize("batch", ["prefill_tile_edges", "prefill_chunk_prefix"])
def test_prefill_variants(config, batch):
    # Qwen3-8B heads, the chunks' own K/V packed as the engine passes them; lengths on both
    # sides of the query- and key-tile boundaries, with and without a cached prefix.
    from atom.ops.triton.prefill_attention import prefill_attention

    q_lens, context_lens = BATCHES[batch]()
    q, k_cache, v_cache, cu, seq_lens, tables = args = make_batch(q_lens, context_lens, 32, 8, 128, 16,
                                                                  torch.bfloat16)  # fmt: skip
    k, v = packed_kv(args, q_lens, context_lens)
    out = torch.full_like(q, float("nan"))  # every element must be written
    prefill_attention(q, out, k_cache, v_cache, cu, seq_lens, tables, 128**-0.5 * 1.4426950408889634, config, k=k,
                      v=v)  # fmt: skip
    assert_close(out, reference_attention(*args, 128**-0.5), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_paged_attention_dtypes(dtype):
    args = make_batch([1] * 4 + [300], [5000, 20, 700, 64, 200], 32, 8, 128, 16, dtype)
    out = tk.paged_attention(*args, 128**-0.5)
    assert_close(out, reference_attention(*args, 128**-0.5), dtype)


@pytest.mark.parametrize("num_splits", [1, 7, 32])
def test_paged_attention_forced_splits(num_splits):
    args = make_batch([1] * 3, [8000, 100, 2500], 32, 8, 128, 16, torch.bfloat16)
    out = tk.paged_attention(*args, 128**-0.5, num_splits=num_splits)
    assert_close(out, reference_attention(*args, 128**-0.5), torch.bfloat16)


@pytest.mark.parametrize("balance, min_keys", [(4, 512), (16, 128)])
@pytest.mark.parametrize("kv_heads", [4, 8])
def test_paged_attention_balance_splits(balance, min_keys, kv_heads, monkeypatch):
    """Large decode batches of uneven contexts split into segments of at least ``min_keys`` keys (the
    sweep's candidates; the decode graphs' max_seqlen_k 4,096), against the reference."""
    from atom.ops.triton import attention

    monkeypatch.setattr(attention, "BALANCE_SPLITS", balance)
    monkeypatch.setattr(attention, "SPLIT_MIN_KEYS", min_keys)
    args = make_batch([1] * 256, torch.randint(1, 4000, (256,)).tolist(), 32, kv_heads, 128, 16, torch.bfloat16)
    assert attention._num_splits(args[0], 256, kv_heads, 1, 4096) == (balance, min_keys)
    out = tk.paged_attention(*args, 128**-0.5, 1, 4096, num_decode_tokens=256)
    assert_close(out, reference_attention(*args, 128**-0.5), torch.bfloat16)


# --- norms, activation, rope + cache ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens, hidden", [(1, 4096), (512, 4096), (4096, 1024), (3, 5120)])
def test_rms_norm(num_tokens, hidden, dtype):
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=DEV)
    residual = torch.randn_like(x)
    weight = 1 + 0.1 * torch.randn(hidden, dtype=dtype, device=DEV)
    out, new_residual = tk.rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_residual = reference.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(new_residual, ref_residual)
    assert_close(out, ref_out, dtype)
    assert_close(tk.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens, inter", [(1, 12288), (512, 3072), (300, 768)])
def test_silu_and_mul(num_tokens, inter, dtype):
    x = torch.randn(num_tokens, 2 * inter, dtype=dtype, device=DEV)
    assert_close(tk.silu_and_mul(x), reference.silu_and_mul(x), dtype, scale=2)


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("model", ["qwen3_8b", "qwen3_0.6b", "d64_mha", "d256_gqa2", "d96_gqa4"])
@pytest.mark.parametrize("num_tokens", [1, 512])
def test_qk_norm_rope_store(model, num_tokens, qk_norm):
    dtype = torch.bfloat16
    num_q_heads, num_kv_heads, head_dim = MODELS[model]
    sizes = [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = torch.randn(num_tokens, sum(sizes), dtype=dtype, device=DEV)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split(sizes, dim=-1))
    q_w = 1 + 0.1 * torch.randn(head_dim, dtype=dtype, device=DEV) if qk_norm else None
    k_w = 1 + 0.1 * torch.randn(head_dim, dtype=dtype, device=DEV) if qk_norm else None
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=DEV).float() / head_dim))
    freqs = torch.outer(torch.arange(40960, device=DEV).float(), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    positions = torch.randint(0, 40960, (num_tokens,), device=DEV)
    k_cache = torch.randn(64, num_kv_heads, 16, head_dim, dtype=dtype, device=DEV)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(64 * 16, device=DEV)[:num_tokens]
    slots[0] = -1
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    out = tk.qk_norm_rope_store(q, k, v, q_w, k_w, 1e-6, positions, cos_sin, k_cache, v_cache, slots)
    ref = reference.qk_norm_rope_store(q, k, v, q_w, k_w, 1e-6, positions, cos_sin, ref_k_cache, ref_v_cache, slots)
    assert_close(out[0], ref[0], dtype, scale=8)
    assert_close(out[1], ref[1], dtype, scale=8)
    assert_close(k_cache, ref_k_cache, dtype, scale=8)
    assert torch.equal(v_cache, ref_v_cache)


# --- MoE --------------------------------------------------------------------------------

QWEN3_MOE = dict(hidden=2048, inter=768, num_experts=128, top_k=8)


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 512, 2048])
def test_fused_moe_qwen3(num_tokens):
    dtype = torch.bfloat16
    h, i, e, k = QWEN3_MOE.values()
    x = torch.randn(num_tokens, h, dtype=dtype, device=DEV)
    w13 = (torch.randn(e, 2 * i, h, device=DEV) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device=DEV) / i**0.5).to(dtype)
    logits = torch.randn(num_tokens, e, dtype=dtype, device=DEV)
    weights, ids = tk.moe_topk(logits, k, True)
    ref_weights, ref_ids = reference.moe_topk(logits, k, True)
    torch.testing.assert_close(weights, ref_weights)
    out = tk.fused_moe(x, w13, w2, weights, ids)
    ref = reference.fused_moe(x.float(), w13.float(), w2.float(), weights.to(dtype).float(), ids)
    assert_close(out, ref, dtype)


# the bf16 MoE's GEMVs (moe_gemv, unscaled): the default launch and sweep candidates, at Qwen3-30B-A3B's and
# DeepSeek-V2-Lite's experts (1,408 columns: masked key steps)
@pytest.mark.parametrize("gemv", [(2, 1024, 2, 4, 256, 2), (4, 1024, 2, 2, 512, 2), (8, 2048, 8, 4, 512, 2)])
@pytest.mark.parametrize("num_tokens, inter, e, k", [(1, 768, 128, 8), (2, 768, 128, 8), (2, 1408, 64, 6)])
def test_fused_moe_gemv(gemv, num_tokens, inter, e, k):
    from atom.ops.triton.fp8_gemv import Fp8GemvConfig
    from atom.ops.triton.moe_gemv import MoeGemvConfig

    dtype, h = torch.bfloat16, 2048
    x = torch.randn(num_tokens, h, dtype=dtype, device=DEV)
    w13 = (torch.randn(e, 2 * inter, h, device=DEV) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, device=DEV) / inter**0.5).to(dtype)
    weights, ids = tk.moe_topk(torch.randn(num_tokens, e, device=DEV), k, True)
    cfg = MoeGemvConfig(Fp8GemvConfig(*gemv[:3]), Fp8GemvConfig(*gemv[3:]))
    out = tk.fused_moe(x, w13, w2, weights, ids, gemv=cfg)
    ref = reference.fused_moe(x.float(), w13.float(), w2.float(), weights.to(dtype).float(), ids)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("group_m", [8, 16])
def test_fused_moe_grouped_tile_order(group_m, monkeypatch):
    """Row tiles in groups across the column tiles (``GROUP_M``) at Qwen3-30B-A3B's experts and 2,048
    tokens: every tile once, the same output as the plain order (the same tiles, another order)."""
    from atom.ops.triton import moe

    h, i, e, k = QWEN3_MOE.values()
    x = torch.randn(2048, h, dtype=torch.bfloat16, device=DEV)
    w13 = (torch.randn(e, 2 * i, h, device=DEV) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, device=DEV) / i**0.5).to(torch.bfloat16)
    weights, ids = tk.moe_topk(torch.randn(2048, e, device=DEV), k, True)
    config = moe._gemm_config(ids.numel(), e, torch.bfloat16)
    monkeypatch.setattr(moe, "_gemm_config", lambda *_: {**config, "GROUP_M": 0})
    expected = tk.fused_moe(x, w13, w2, weights, ids)
    monkeypatch.setattr(moe, "_gemm_config", lambda *_: {**config, "GROUP_M": group_m})
    assert torch.equal(tk.fused_moe(x, w13, w2, weights, ids), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fused_moe_dtypes(dtype):
    x = torch.randn(300, 1024, dtype=dtype, device=DEV)
    w13 = (torch.randn(16, 2 * 384, 1024, device=DEV) / 32).to(dtype)
    w2 = (torch.randn(16, 1024, 384, device=DEV) / 384**0.5).to(dtype)
    weights, ids = reference.moe_topk(torch.randn(300, 16, device=DEV), 4, False)
    out = tk.fused_moe(x, w13, w2, weights, ids)
    ref = reference.fused_moe(x.float(), w13.float(), w2.float(), weights.to(dtype).float(), ids)
    assert_close(out, ref, dtype)


# DeepSeek routings at their real sizes: V2-Lite, V2 (group-limited), V3/R1 (noaux_tc), Kimi-K2
DEEPSEEK_ROUTINGS = {
    "v2_lite": (64, 6, "softmax", 1, 1, False, False, 1.0),
    "v2": (160, 6, "softmax", 8, 3, False, False, 16.0),
    "v3": (256, 8, "sigmoid", 8, 4, True, True, 2.5),
    "kimi_k2": (384, 8, "sigmoid", 1, 1, True, True, 2.827),
}


@pytest.mark.parametrize("num_tokens", [1, 256, 8192])
@pytest.mark.parametrize("routing", DEEPSEEK_ROUTINGS.values(), ids=DEEPSEEK_ROUTINGS.keys())
def test_grouped_topk_deepseek(routing, num_tokens):
    """The one-launch routing against the reference on float32 logits: the same experts (as
    sets) and weights, the fused shared experts (V2's two, V3's one) included."""
    num_experts, top_k, scoring, groups, topk_groups, bias, renormalize, scaling = routing
    logits = torch.randn(num_tokens, num_experts, device=DEV) * 2
    correction = torch.randn(num_experts, device=DEV) * 0.5 if bias else None
    args = (top_k, scoring, groups, topk_groups, correction, renormalize, scaling, 1 if bias else 2)
    weights, ids = tk.grouped_topk(logits, *args)
    ref_weights, ref_ids = reference.grouped_topk(logits, *args)
    order, ref_order = ids.argsort(dim=1), ref_ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 6, 2048), (8192, 6, 2048), (256, 8, 7168)])
def test_moe_sum_deepseek(shape):
    from atom.ops.triton.moe import moe_sum

    pairs = torch.randn(*shape, dtype=torch.bfloat16, device=DEV)
    assert_close(moe_sum(pairs), pairs.double().sum(dim=1), torch.bfloat16)


# --- sampling ---------------------------------------------------------------------------




def test_top_k_top_p_min_p_full_vocab():
    rows, vocab = 64, 151936
    # Distinct values (sorted normal samples nudged apart), shuffled per row.
    base = torch.randn(vocab, device=DEV).sort().values * 3 + torch.arange(vocab, device=DEV) * 2e-6
    logits = torch.stack([base[torch.randperm(vocab, device=DEV)] for _ in range(rows)])
    top_k = torch.randint(0, 200, (rows,), device=DEV)
    top_p = torch.rand(rows, device=DEV) * 0.95 + 0.05
    top_p[::4] = 1.0
    min_p = torch.rand(rows, device=DEV) * 0.1
    for args in [(top_k, None, None), (None, top_p, None), (top_k, top_p, min_p)]:
        out = tk.top_k_top_p_min_p(logits, *args)
        ref = reference.top_k_top_p_min_p(logits, *args)
        differ = out.isinf() != ref.isinf()
        # The reference sums probabilities in sorted order, the kernel in blocks.
        assert not (differ & ~rounding_sensitive(logits, *args)).any()
