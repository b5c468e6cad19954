"""FP8 kernels vs their references at real shapes, on CUDA (Hopper: e4m3 tensor cores).

Run in its own pytest process (``pytest tests/gpu/test_fp8_gpu.py``).

- KV cache: the fused RoPE + cache write stores the reference's e4m3 bits; paged attention
  (decode, split-K, prefill) over an fp8 cache matches the reference over the dequantised cache
  (bf16 tolerance 2e-2 of the output's magnitude, as tests/gpu/test_kernels_gpu.py).
- GEMM: the Triton w8a8 GEMM (block 128x128 and per-channel) matches the float32 reference on
  the same quantised inputs to bf16 rounding, and ``torch._scaled_mm`` (rowwise) agrees with it;
  so does the skinny kernel it takes up to 16 rows (each way of multiplying a tile), inside a
  CUDA graph and under torch.compile with a dynamic batch.
- MoE: the Triton FP8 fused MoE matches the reference within 2% (see tests/kernels/test_moe_fp8.py).
"""

import functools
import os

import pytest
import torch

from atom import ops
from atom.ops import reference, reference_fp8

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton", allow_module_level=True)

from atom.ops.triton import gemv, paged_attention  # noqa: E402
from atom.ops.triton.fp8_configs import GEMV_MAX_ROWS, SKINNY_MAX_ROWS, gemv_config  # noqa: E402
from atom.ops.triton.fp8_gemm import (  # noqa: E402
    fp8_linear,
    per_token_group_quant_fp8,
    scaled_mm_block_scales,
    w8a8_matmul,
)
from atom.ops.triton.fp8_gemv import Fp8GemvConfig, fp8_gemv  # noqa: E402
from atom.ops.triton.gemv import GemvConfig, skinny_gemm  # noqa: E402
from atom.ops.triton.moe_fp8 import fused_moe_fp8  # noqa: E402
from atom.ops.triton.moe_gemv import MoeGemvConfig  # noqa: E402
from atom.ops.triton.rope_cache import store_kv_cache  # noqa: E402

DEV = "cuda"
FP8 = torch.float8_e4m3fn
BF16_TOL = 2e-2


def assert_close(out, ref, tol=BF16_TOL):
    assert out.shape == ref.shape and not out.isnan().any()
    err = (out.double() - ref.double()).abs().max().item()
    magnitude = max(1.0, ref.abs().max().item())
    assert err <= tol * magnitude, f"max abs error {err} at magnitude {magnitude}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))


# --- KV cache ------------------------------------------------------------------------------

def test_store_kv_cache_fp8_bits():
    k = torch.randn(4096, 8, 128, device=DEV, dtype=torch.bfloat16) * 3
    v = torch.randn_like(k)
    slots = torch.randperm(1024 * 16, device=DEV)[:4096]
    scales = torch.tensor([0.02], device=DEV), torch.tensor([0.03], device=DEV)
    caches = [torch.zeros(1024, 8, 16, 128, device=DEV, dtype=FP8) for _ in range(4)]
    store_kv_cache(k, v, caches[0], caches[1], slots, *scales)
    reference.store_kv_cache(k, v, caches[2], caches[3], slots, *scales)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))


@pytest.mark.parametrize("q_lens, context_lens", [
    ([1] * 64, [2048] * 64),  # decode batch
    ([1], [8000]),  # batch-1 decode: split-K
    ([1024], [0]),  # prefill
    ([512, 1, 1], [1500, 300, 4000]),  # mixed, decodes not first
])
def test_paged_attention_fp8(q_lens, context_lens):
    hq, hk, d, bs = 32, 8, 128, 16  # Qwen3-8B
    seq_lens = torch.tensor([c + q for c, q in zip(context_lens, q_lens)], dtype=torch.int32, device=DEV)
    max_blocks = -(-int(seq_lens.max()) // bs)
    num_blocks = len(q_lens) * max_blocks + 3
    tables = torch.randperm(num_blocks, dtype=torch.int32, device=DEV)[: len(q_lens) * max_blocks]
    tables = tables.view(len(q_lens), max_blocks)
    k_scale, v_scale = torch.tensor([0.01], device=DEV), torch.tensor([0.005], device=DEV)
    k_cache = (torch.randn(num_blocks, hk, bs, d, device=DEV) / k_scale).clamp(-448, 448).to(FP8)
    v_cache = (torch.randn(num_blocks, hk, bs, d, device=DEV) / v_scale).clamp(-448, 448).to(FP8)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=DEV)
    cu[1:] = torch.tensor(q_lens, device=DEV).cumsum(0)
    q = torch.randn(int(cu[-1]), hq, d, device=DEV, dtype=torch.bfloat16)
    out = paged_attention(q, k_cache, v_cache, cu, seq_lens, tables, d**-0.5, None, None, 0, None, None,
                          k_scale, v_scale)
    ref = reference.paged_attention(q.float(), k_cache, v_cache, cu, seq_lens, tables, d**-0.5,
                                    k_scale=k_scale, v_scale=v_scale)
    assert_close(out, ref)


# --- GEMM ----------------------------------------------------------------------------------

# Qwen3-8B projections (N, K): qkv, o, gate_up, down
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


@pytest.mark.parametrize("m", [1, 3, 16, 17, 256, 4096])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("group_k", [128, 0])
def test_w8a8_matmul(m, n, k, group_k):
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w, w_s = reference_fp8.quantize_weight(torch.randn(n, k, device=DEV) * 0.02, group_k, group_k or 1)
    a, a_s = per_token_group_quant_fp8(x, group_k)
    a_ref, a_s_ref = reference_fp8.per_token_group_quant_fp8(x, group_k)
    assert torch.equal(a.view(torch.uint8), a_ref.view(torch.uint8)) and torch.equal(a_s, a_s_ref)
    out = w8a8_matmul(a, a_s, w, w_s, group_k, torch.bfloat16)
    ref = reference_fp8.w8a8_matmul(a, a_s, w, w_s, group_k, torch.float32)
    assert_close(out, ref)
    if group_k == 0:
        mm = torch._scaled_mm(a, w.t(), scale_a=a_s, scale_b=w_s.t(), out_dtype=torch.bfloat16)
        assert_close(mm, ref)
    else:  # the FP8 layers' default: torch._scaled_mm block-wise above the skinny rows
        block_scale = scaled_mm_block_scales(w, w_s, group_k)
        assert block_scale is not None, "block-wise _scaled_mm refused here (see the warning)"
        assert_close(w8a8_matmul(a, a_s, w, w_s.t().contiguous().t(), group_k, torch.bfloat16, None, block_scale), ref)


@pytest.mark.parametrize("m", [1, 4, 16, 17])
@pytest.mark.parametrize("n, k", SHAPES)
def test_fp8_linear(m, n, k):
    # the block-scaled FP8 layer's op: at decode rows one launch that quantises the activations
    # itself: at one row the CUDA-core GEMV, else the skinny kernel, bit for bit the quantisation
    # kernel then the skinny kernel
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w, w_s = reference_fp8.quantize_weight(torch.randn(n, k, device=DEV) * 0.02, 128, 128)
    block_scale = scaled_mm_block_scales(w, w_s, 128)
    w_s = w_s.t().contiguous().t()
    out = fp8_linear(x, w, w_s, 128, None, block_scale)
    a, a_s = per_token_group_quant_fp8(x, 128)
    assert_close(out, reference_fp8.w8a8_matmul(a, a_s, w, w_s, 128, torch.float32))
    gemv_cfg = gemv_config(n, k, 128)
    if m <= GEMV_MAX_ROWS and gemv_cfg is not None:
        assert torch.equal(out, fp8_gemv(x, w, w_s, 128, gemv_cfg))
    elif m <= SKINNY_MAX_ROWS:
        assert torch.equal(out, w8a8_matmul(a, a_s, w, w_s, 128, torch.bfloat16))


# the FP8 MLP's gate / up op with the activation in the skinny launch (fp8_gemm.GATED_MAX_ROWS) at Qwen3-8B's
# gate_up, 1-16 rows (key splits: SiLU-mul in the reduction): the bits of the skinny kernel over the weight's
# rows in the product's order, then silu_and_mul, and near the reference
@pytest.mark.parametrize("m", [1, 4, 16])
def test_fp8_gated_linear(m, monkeypatch):
    from atom.ops.triton import fp8_gemm
    from atom.ops.triton.fp8_configs import skinny_config

    n, k = 2 * 12288, 4096
    monkeypatch.setattr(fp8_gemm, "GATED_MAX_ROWS", SKINNY_MAX_ROWS)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w, w_s = reference_fp8.quantize_weight(torch.randn(n, k, device=DEV) * 0.02, 128, 128)
    w_s = w_s.t().contiguous().t()
    out = fp8_gemm.fp8_gated_linear(x, w, w_s, 128)
    order = torch.arange(n, device=DEV).view(2, n // 2).t().reshape(-1)
    product = skinny_gemm(x, w[order], None, skinny_config(n, k, 128), scales=(None, w_s[order], 128),
                          out_dtype=x.dtype)  # fmt: skip
    assert skinny_config(n, k, 128).split_k > 1
    unfused = ops.silu_and_mul(torch.cat([product[:, 0::2], product[:, 1::2]], 1))
    torch.testing.assert_close(out, unfused, atol=0, rtol=0)
    a, a_s = per_token_group_quant_fp8(x, 128)
    assert_close(out, reference.silu_and_mul(reference_fp8.w8a8_matmul(a, a_s, w, w_s, 128, torch.float32)))


# the CUDA-core GEMV's launches (decode_chain.py's candidates), ragged K and N included
@pytest.mark.parametrize("cfg", [
    Fp8GemvConfig(block_n=4, block_k=1024, num_warps=2), Fp8GemvConfig(block_n=8, block_k=1024),
    Fp8GemvConfig(block_n=16, block_k=2048, num_warps=8), Fp8GemvConfig(block_n=8, block_k=512, num_stages=3),
    Fp8GemvConfig(block_n=8, block_k=1024, half=False),
], ids=lambda c: f"n{c.block_n}-k{c.block_k}-w{c.num_warps}-s{c.num_stages}-{'f16' if c.half else 'f32'}")  # fmt: skip
@pytest.mark.parametrize("n, k", [*SHAPES, (1000, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_gemv(cfg, n, k, dtype):
    x = torch.randn(2, k, device=DEV, dtype=dtype) * 3
    w, w_s = reference_fp8.quantize_weight(torch.randn(n, k, device=DEV) * 0.02, 128, 128)
    w_s = w_s.t().contiguous().t()
    bias = torch.randn(n, device=DEV, dtype=dtype)
    out = fp8_gemv(x, w, w_s, 128, cfg, bias)
    assert out.dtype == dtype
    assert_close(out, reference_fp8.fp8_linear(x.float(), w, w_s, 128, bias.float()))


def test_fp8_gemv_in_cuda_graph():
    # one row, as a batch-1 decode step replays it: the graph's output is the eager bits
    n, k = 6144, 4096
    w, w_s = reference_fp8.quantize_weight(torch.randn(n, k, device=DEV) * 0.02, 128, 128)
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    fp8_linear(x, w, w_s, 128)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, w, w_s, 128)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, fp8_linear(x, w, w_s, 128), atol=0, rtol=0)


def fp8_gemm_inputs(m, n, k, group_k):
    w, w_s = reference_fp8.quantize_weight(torch.randn(n, k, device=DEV) * 0.02, group_k, group_k or 1)
    a, a_s = per_token_group_quant_fp8(torch.randn(m, k, device=DEV, dtype=torch.bfloat16), group_k)
    return a, a_s, w, w_s.t().contiguous().t()  # weight scales K-major, as the FP8 layers keep them


# the skinny kernel's other ways of multiplying a tile (fp8_gemm_probe.py --sweep's candidates)
@pytest.mark.parametrize("cfg", [
    GemvConfig(block_n=128, block_k=128, split_k=2, mode="dot_t", num_stages=3),
    GemvConfig(block_n=32, block_k=128, split_k=4, mode="dot"),
    GemvConfig(block_n=16, block_k=128, split_k=2, mode="sum", num_stages=3),
    GemvConfig(block_n=64, block_k=128, mode="dot_t", num_warps=8, num_stages=6),
], ids=lambda c: f"{c.mode}-n{c.block_n}-s{c.split_k}-w{c.num_warps}")  # fmt: skip
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("group_k", [128, 0])
def test_skinny_w8a8_configs(cfg, m, group_k):
    a, a_s, w, w_s = fp8_gemm_inputs(m, 4096, 12288, group_k)
    bias = torch.randn(4096, device=DEV, dtype=torch.bfloat16)
    out = skinny_gemm(a, w, bias, cfg, scales=(a_s, w_s, group_k), out_dtype=torch.bfloat16)
    assert_close(out, reference_fp8.w8a8_matmul(a, a_s, w, w_s, group_k, torch.float32, bias))


def test_skinny_w8a8_in_cuda_graph_and_compiled():
    # the op as the FP8 layers call it: every row count up to SKINNY_MAX_ROWS replays from a
    # graph with the eager bits, all from one compiled variant of the kernel (activation scales
    # quantised per batch: their stride is the row count); compiled with a dynamic batch, across
    # the skinny / tile switch
    n, k = 6144, 4096
    _, _, w, w_s = fp8_gemm_inputs(1, n, k, 128)

    def gemm(a, a_s):
        return ops.w8a8_matmul(a, a_s, w, w_s, 128, torch.bfloat16)

    def variants():
        return sum(len(cache[0]) for cache in gemv._skinny_gemm_kernel.device_caches.values())

    for m in range(1, SKINNY_MAX_ROWS + 1):
        a, a_s = per_token_group_quant_fp8(torch.randn(m, k, device=DEV, dtype=torch.bfloat16), 128)
        gemm(a, a_s)  # compile outside the capture
        if m == 1:
            compiled = variants()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gemm(a, a_s)
        graph.replay()
        torch.testing.assert_close(out, gemm(a, a_s), atol=0, rtol=0)
    assert variants() == compiled
    ops.init_device_ops(torch.device(DEV))
    fn = torch.compile(lambda a, a_s: gemm(a, a_s) * 2, dynamic=True, fullgraph=True)
    for m in (1, 7, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 40):
        a, a_s = per_token_group_quant_fp8(torch.randn(m, k, device=DEV, dtype=torch.bfloat16), 128)
        torch.testing.assert_close(fn(a, a_s), gemm(a, a_s) * 2, atol=0, rtol=0)


# --- MoE -----------------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
@pytest.mark.parametrize("group_k", [128, 0])
def test_fused_moe_fp8(num_tokens, group_k):
    hidden, inter, experts, top_k = 2048, 768, 128, 8  # Qwen3-30B-A3B
    x = torch.randn(num_tokens, hidden, device=DEV, dtype=torch.bfloat16)
    q13 = [reference_fp8.quantize_weight(torch.randn(2 * inter, hidden, device=DEV) * 0.02, group_k, group_k or 1)
           for _ in range(experts)]
    q2 = [reference_fp8.quantize_weight(torch.randn(hidden, inter, device=DEV) * 0.02, group_k, group_k or 1)
          for _ in range(experts)]
    w13, s13 = torch.stack([q for q, _ in q13]), torch.stack([s for _, s in q13])
    w2, s2 = torch.stack([q for q, _ in q2]), torch.stack([s for _, s in q2])
    weights, ids = reference.moe_topk(torch.randn(num_tokens, experts, device=DEV), top_k, True)
    out = fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, group_k)
    ref = reference_fp8.fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, group_k)
    assert_close(out, ref, tol=0.02)


def moe_fp8_inputs(num_tokens, hidden, inter, experts, top_k):
    """Block-128 expert weights (K-major scales, as the FP8 MoE layer keeps them) and routes."""
    out = []
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):
        q = [reference_fp8.quantize_weight(torch.randn(rows, cols, device=DEV) * 0.02, 128, 128)
             for _ in range(experts)]  # fmt: skip
        scales = torch.stack([s for _, s in q]).transpose(1, 2).contiguous().transpose(1, 2)
        out += [torch.stack([w for w, _ in q]), scales]
    x = torch.randn(num_tokens, hidden, device=DEV, dtype=torch.bfloat16)
    weights, ids = reference.moe_topk(torch.randn(num_tokens, experts, device=DEV), top_k, True)
    return x, *out, weights, ids


# the few-token FP8 MoE (CUDA-core GEMVs): the default launch and sweep candidates (narrow / wide row
# blocks, 2,048 keys a step, a masked down key step)
@pytest.mark.parametrize("cfg", [
    None,
    MoeGemvConfig(Fp8GemvConfig(8, 2048, 8), Fp8GemvConfig(32, 256)),
    MoeGemvConfig(Fp8GemvConfig(4, 1024, 2), Fp8GemvConfig(16, 1024)),
])  # fmt: skip
@pytest.mark.parametrize("num_tokens, hidden, inter, experts, top_k", [
    (1, 2048, 768, 128, 8),  # Qwen3-30B-A3B
    (4, 2048, 768, 128, 8),
    (1, 7168, 2048, 16, 8),  # DeepSeek-V3's expert shapes (fewer experts)
    (3, 2048, 1408, 16, 6),  # DeepSeek-V2-Lite's
])  # fmt: skip
def test_fused_moe_fp8_gemv(cfg, num_tokens, hidden, inter, experts, top_k):
    from atom.ops.triton.fp8_configs import moe_gemv_config

    x, w13, s13, w2, s2, weights, ids = moe_fp8_inputs(num_tokens, hidden, inter, experts, top_k)
    cfg = cfg or moe_gemv_config(1, 2048, 768, 128)
    out = fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, 128, config=cfg)
    assert_close(out, reference_fp8.fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, 128), tol=0.02)


def test_fused_moe_fp8_gemv_in_cuda_graph():
    # one token, as a batch-1 decode step replays it, new activations and routes: the eager bits
    x, w13, s13, w2, s2, weights, ids = moe_fp8_inputs(1, 2048, 768, 128, 8)
    moe = functools.partial(fused_moe_fp8, x, w13, s13, w2, s2, weights, ids, 128)
    moe()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe()
    x2, *_, weights2, ids2 = moe_fp8_inputs(1, 2048, 768, 128, 8)
    for t, new in ((x, x2), (weights, weights2), (ids, ids2)):
        t.copy_(new)
    graph.replay()
    torch.testing.assert_close(out, moe(), atol=0, rtol=0)


@pytest.mark.parametrize("num_tokens", [16, 256, 2048])
@pytest.mark.parametrize("override", [{"GROUP_M": 0}, {"GROUP_M": 32}])
def test_fused_moe_fp8_candidates(num_tokens, override):
    """The sweep's FP8 MoE candidates on the table's tiles (row tiles in order, in groups of 32) at
    Qwen3-30B-A3B's experts, against the reference."""
    from atom.ops.triton.fp8_configs import moe_config

    hidden, inter, experts, top_k = 2048, 768, 128, 8
    x = torch.randn(num_tokens, hidden, device=DEV, dtype=torch.bfloat16)
    q13 = [reference_fp8.quantize_weight(torch.randn(2 * inter, hidden, device=DEV) * 0.02, 128, 128)
           for _ in range(experts)]
    q2 = [reference_fp8.quantize_weight(torch.randn(hidden, inter, device=DEV) * 0.02, 128, 128)
          for _ in range(experts)]
    w13, s13 = torch.stack([q for q, _ in q13]), torch.stack([s for _, s in q13])
    w2, s2 = torch.stack([q for q, _ in q2]), torch.stack([s for _, s in q2])
    weights, ids = reference.moe_topk(torch.randn(num_tokens, experts, device=DEV), top_k, True)
    config = {**moe_config(num_tokens * top_k / experts, True), **override}
    out = fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, 128, config=config)
    ref = reference_fp8.fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, 128)
    assert_close(out, ref, tol=0.02)


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_rms_norm_fp8_codes(rows):
    # the norm's e4m3 codes and scales: per_token_group_quant_fp8 of its output, bit for bit, at Qwen3-8B's hidden
    from atom.ops.triton.fp8_gemm import per_token_group_quant_fp8
    from atom.ops.triton.norm import rms_norm_fp8

    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16) * 2
    res = torch.randn_like(x)
    weight = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    out, new_res, codes, scales = rms_norm_fp8(x, weight, 1e-6, res)
    want_out, want_res = ops.rms_norm(x, weight, 1e-6, res)
    assert torch.equal(out, want_out) and torch.equal(new_res, want_res)
    want_codes, want_scales = per_token_group_quant_fp8(out, 128)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scales, want_scales)


# the FP8 linears given the norm's codes (the models' post-attention norm -> gate_up) at Qwen3-8B's gate_up and
# down, the GEMV's row, the skinny kernel (the gated launch at one row) and the tile GEMM / cuBLASLt: the bits
# of quantising in the op
@pytest.mark.parametrize("m", [1, 4, 16, 64])
@pytest.mark.parametrize("gated", [False, True])
def test_fp8_linear_given_the_norms_codes(m, gated):
    from atom.ops.triton import fp8_gemm
    from atom.ops.triton.norm import rms_norm_fp8

    n, k = (2 * 12288, 4096) if gated else (4096, 4096)
    h = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    normed, _, codes, scales = rms_norm_fp8(h, torch.rand(k, device=DEV, dtype=torch.bfloat16) + 0.5, 1e-6)
    w, w_s = reference_fp8.quantize_weight(torch.randn(n, k, device=DEV) * 0.02, 128, 128)
    w_s = w_s.t().contiguous().t()
    block = fp8_gemm.scaled_mm_block_scales(w, w_s, 128)
    op = fp8_gemm.fp8_gated_linear if gated else fp8_gemm.fp8_linear
    given = op(normed, w, w_s, 128, None, block, codes, scales)
    torch.testing.assert_close(given, op(normed, w, w_s, 128, None, block), atol=0, rtol=0)
    assert not torch.equal(op(normed, w, w_s, 128, None, block, torch.zeros_like(codes), scales), given)  # read
