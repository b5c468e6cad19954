"""FP8 GEMM kernels under the interpreter against ``atom.ops.reference_fp8``: activation
quantisation bit for bit, the scaled matmul to float32 rounding (both sum the same e4m3
products times the same scales, in a different order)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from atom import ops
from atom.ops import reference_fp8 as ref
from atom.ops.triton import fp8_configs, fp8_gemm
from atom.ops.triton.fp8_configs import SKINNY_MAX_ROWS, gemm_config, skinny_config
from atom.ops.triton.fp8_gemm import per_token_group_quant_fp8, w8a8_matmul
from atom.ops.triton.fp8_gemv import Fp8GemvConfig, fp8_gemv
from atom.ops.triton.gemv import GemvConfig, skinny_gemm


# (70, 256, 128): three programs of 32 rows, the last one partly past the rows
@pytest.mark.parametrize("m, k, group_k", [(1, 128, 128), (5, 200, 32), (33, 72, 0), (7, 256, 128), (70, 256, 128)])
def test_per_token_group_quant(m, k, group_k, dtype):
    x = (torch.randn(m, k) * torch.exp(torch.randn(m, 1) * 2)).to(dtype)
    x[0, :] = 0  # an all-zero row keeps a finite scale
    q, s = per_token_group_quant_fp8(x, group_k)
    q_ref, s_ref = ref.per_token_group_quant_fp8(x, group_k)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # the quantisation itself is close: e4m3 keeps 3 mantissa bits
    err = (ref.dequantize(q, s, group_k) - x.float()).abs()
    assert (err <= x.float().abs() / 16 + s.max() * 2**-9).all()

    # one layout for the kernel, the reference and the op's fake tensor, which torch.compile
    # checks the kernel's outputs against (the strides of dimensions longer than 1)
    with FakeTensorMode() as mode:
        fake = ops._OPS["per_token_group_quant_fp8"].fake(mode.from_tensor(x), group_k)
    for kernel_out, ref_out, fake_out in zip((q, s), (q_ref, s_ref), fake):
        layouts = {(t.shape, tuple(st for n, st in zip(t.shape, t.stride()) if n > 1), t.dtype)
                   for t in (kernel_out, ref_out, fake_out)}
        assert len(layouts) == 1, layouts


# (m, n, k, group_k, block_n): block-scaled (128x128 like DeepSeek-V3, and small blocks with
# partial edge blocks) and per-channel (group_k 0)
CASES = [(1, 256, 256, 128, 128), (17, 96, 200, 32, 32), (64, 144, 72, 32, 32), (3, 136, 72, 0, 1),
         (130, 80, 160, 0, 1)]


@pytest.mark.parametrize("m, n, k, group_k, block_n", CASES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_matmul(m, n, k, group_k, block_n, out_dtype, bias, assert_close):
    x = torch.randn(m, k)
    w_q, w_s = ref.quantize_weight(torch.randn(n, k) * 0.1, group_k, block_n)
    a_q, a_s = ref.per_token_group_quant_fp8(x, group_k)
    b = torch.randn(n) if bias else None
    out = w8a8_matmul(a_q, a_s, w_q, w_s, group_k, out_dtype, b)
    expected = ref.w8a8_matmul(a_q, a_s, w_q, w_s, group_k, torch.float32, b)
    assert out.dtype == out_dtype
    assert_close(out, expected, out_dtype)


def test_quantize_weight_block_layout():
    # 128x128 blocks: the row-expanded scales repeat each block's scale over its 128 rows
    w = torch.randn(300, 260)
    q, s = ref.quantize_weight(w, 128, 128)
    assert s.shape == (300, 3) and torch.equal(s[:128], s[:1].expand(128, 3)) and not torch.equal(s[0], s[128])
    assert ((ref.dequantize(q, s, 128) - w).abs() <= w.abs() / 16 + s.max() * 2**-9).all()


# what the tile tables and the sweep may pick: split-K (an empty last split, a bias added
# after the partial sums), a per-channel key tile narrower than K, and both scale layouts
# (activation scales row- or column-major, weight scales K-major as the FP8 layers keep them)
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("group_k", [32, 0])
@pytest.mark.parametrize("column_major", [True, False])
def test_w8a8_matmul_split_k_and_scale_layouts(split_k, group_k, column_major, assert_close):
    m, n, k = 19, 96, 200
    x = torch.randn(m, k)
    w_q, w_s = ref.quantize_weight(torch.randn(n, k) * 0.1, group_k, group_k or 1)
    a_q, a_s = per_token_group_quant_fp8(x, group_k, column_major=column_major)
    assert (a_s.stride(0) == 1) == (column_major or a_s.shape[1] == 1)
    a_ref, s_ref = ref.per_token_group_quant_fp8(x, group_k)
    assert torch.equal(a_s, s_ref) and torch.equal(a_q.view(torch.uint8), a_ref.view(torch.uint8))
    b = torch.randn(n)
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, SPLIT_K=split_k, num_warps=4, num_stages=2)
    out = w8a8_matmul(a_q, a_s, w_q, w_s.t().contiguous().t(), group_k, torch.float32, b, config=config)
    assert_close(out, ref.w8a8_matmul(a_q, a_s, w_q, w_s, group_k, torch.float32, b), torch.float32)


# the skinny kernel (few rows, atom.ops.triton.gemv) with FP8 scales: block scales with odd
# N / K (a partial last group and a partial last weight block), per-channel scales, each way
# of multiplying a tile that applies block scales, with and without a key split
SKINNY_CASES = [
    # (m, n, k, group_k, block_n, cfg)
    (1, 37, 200, 32, 32, GemvConfig(block_n=64, block_k=128, split_k=2, mode="dot_t")),
    (16, 100, 96, 32, 32, GemvConfig(block_n=16, block_k=128, mode="dot")),
    (3, 70, 72, 16, 32, GemvConfig(block_n=8, block_k=128, split_k=3, mode="sum")),
    (5, 50, 130, 0, 1, GemvConfig(block_n=32, block_k=32, split_k=2, mode="dot_t")),
    (2, 33, 100, 0, 1, GemvConfig(block_n=4, block_k=64, mode="defer")),
]


@pytest.mark.parametrize("m, n, k, group_k, block_n, cfg", SKINNY_CASES)
def test_skinny_w8a8(m, n, k, group_k, block_n, cfg, assert_close):
    x = torch.randn(m, k) * torch.exp(torch.randn(m, 1))
    w_q, w_s = ref.quantize_weight(torch.randn(n, k) * 0.1, group_k, block_n)
    a_q, a_s = per_token_group_quant_fp8(x, group_k)
    b = torch.randn(n).to(torch.bfloat16)
    # K-major weight scales, as the FP8 layers keep them
    out = skinny_gemm(a_q, w_q, b, cfg, scales=(a_s, w_s.t().contiguous().t(), group_k), out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert_close(out, ref.w8a8_matmul(a_q, a_s, w_q, w_s, group_k, torch.float32, b), torch.float32)


def test_skinny_w8a8_defer_rejects_block_scales():
    a_q, a_s = ref.per_token_group_quant_fp8(torch.randn(2, 64), 32)
    w_q, w_s = ref.quantize_weight(torch.randn(8, 64), 32, 8)
    with pytest.raises(ValueError, match="defer"):
        skinny_gemm(a_q, w_q, None, GemvConfig(block_n=8, block_k=32, mode="defer"), scales=(a_s, w_s, 32))


@pytest.mark.parametrize("group_k", [32, 0])
def test_w8a8_matmul_takes_the_skinny_kernel_for_few_rows(group_k, assert_close):
    # up to SKINNY_MAX_ROWS rows: the skinny kernel with skinny_config's launch (the same
    # bits); one row more: the tile kernel with the table's config
    n, k = 72, 160
    w_q, w_s = ref.quantize_weight(torch.randn(n, k) * 0.1, group_k, group_k or 1)
    w_s = w_s.t().contiguous().t()  # K-major, as the FP8 layers keep them
    for m in (1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1):
        a_q, a_s = per_token_group_quant_fp8(torch.randn(m, k), group_k)
        out = w8a8_matmul(a_q, a_s, w_q, w_s, group_k, torch.bfloat16)
        if m <= SKINNY_MAX_ROWS:
            same = skinny_gemm(a_q, w_q, None, skinny_config(n, k, group_k), scales=(a_s, w_s, group_k),
                               out_dtype=torch.bfloat16)  # fmt: skip
        else:
            same = w8a8_matmul(a_q, a_s, w_q, w_s, group_k, torch.bfloat16, config=gemm_config(m, n, k, group_k > 0))
        assert torch.equal(out, same)
        assert_close(out, ref.w8a8_matmul(a_q, a_s, w_q, w_s, group_k, torch.float32), torch.bfloat16)


def test_scaled_mm_block_scales_checks_once_and_falls_back(monkeypatch, caplog):
    # the block scales for torch._scaled_mm: only 128-column groups with one scale per
    # 128x128 block, and only where a trial product runs (once per shape). The CPU's
    # _scaled_mm has no block-wise mode: the trial fails, the Triton GEMM stays
    monkeypatch.setattr(fp8_gemm, "_SCALED_MM_BLOCK_OK", {})
    w_q, w_s = ref.quantize_weight(torch.randn(256, 384), 128, 128)
    for _ in range(2):
        assert fp8_gemm.scaled_mm_block_scales(w_q, w_s, 128) is None
    assert fp8_gemm._SCALED_MM_BLOCK_OK == {("cpu", 256, 384): False}
    assert len([r for r in caplog.records if "block-wise" in r.message]) == 1
    w_q, w_s = ref.quantize_weight(torch.randn(256, 384), 128, 64)  # blocks of 64 rows
    assert fp8_gemm.scaled_mm_block_scales(w_q, w_s, 128) is None
    w_q, w_s = ref.quantize_weight(torch.randn(256, 384), 0, 1)
    assert fp8_gemm.scaled_mm_block_scales(w_q, w_s, 0) is None
    assert len(fp8_gemm._SCALED_MM_BLOCK_OK) == 1  # no trial for either


def test_w8a8_matmul_takes_scaled_mm_above_the_skinny_rows():
    # with w_block_scale, more than SKINNY_MAX_ROWS rows go to torch._scaled_mm (on the CPU it
    # has no block-wise mode and raises: the dispatch reached it); fewer stay on the skinny kernel
    n, k = 128, 256
    w_q, w_s = ref.quantize_weight(torch.randn(n, k), 128, 128)
    blocks = w_s[::128].contiguous().t()
    a_q, a_s = per_token_group_quant_fp8(torch.randn(SKINNY_MAX_ROWS + 1, k), 128)
    out = w8a8_matmul(a_q[:2], a_s[:2], w_q, w_s, 128, torch.bfloat16, w_block_scale=blocks)
    assert torch.equal(out, w8a8_matmul(a_q[:2], a_s[:2], w_q, w_s, 128, torch.bfloat16))
    with pytest.raises((RuntimeError, ValueError, NotImplementedError)):
        w8a8_matmul(a_q, a_s, w_q, w_s, 128, torch.bfloat16, w_block_scale=blocks)


@pytest.mark.parametrize("m, n, k, group_k, cfg", [
    (1, 37, 200, 32, GemvConfig(block_n=64, block_k=128, split_k=2, mode="dot_t")),
    (5, 70, 72, 16, GemvConfig(block_n=8, block_k=128, split_k=2, mode="sum")),
    (16, 100, 96, 32, GemvConfig(block_n=16, block_k=128, mode="dot")),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_skinny_w8a8_quantises_activations_in_the_kernel(m, n, k, group_k, cfg, dtype):
    # 16-bit activations quantised group by group inside the skinny kernel give the bits of
    # the quantisation kernel followed by the same launch (codes and scales bit for bit)
    x = (torch.randn(m, k) * torch.exp(torch.randn(m, 1) * 2)).to(dtype)
    x[0, :7] = 0  # a partly zero group
    w_q, w_s = ref.quantize_weight(torch.randn(n, k) * 0.1, group_k, 32)
    w_s = w_s.t().contiguous().t()
    a_q, a_s = per_token_group_quant_fp8(x, group_k)
    fused = skinny_gemm(x, w_q, None, cfg, scales=(None, w_s, group_k), out_dtype=torch.float32)
    assert torch.equal(fused, skinny_gemm(a_q, w_q, None, cfg, scales=(a_s, w_s, group_k), out_dtype=torch.float32))
    with pytest.raises(ValueError, match="block scales"):
        skinny_gemm(x, w_q, None, cfg, scales=(None, w_s, 0))


@pytest.mark.parametrize("m", [1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 3])
@pytest.mark.parametrize("group_k", [128, 0])
def test_fp8_linear(m, group_k, assert_close):
    # the FP8 layer's op: one skinny launch for a few rows with block scales, quantisation then
    # w8a8_matmul otherwise; either way the reference's product (same codes and scales)
    n, k = 72, 256
    x = torch.randn(m, k).to(torch.bfloat16)
    w_q, w_s = ref.quantize_weight(torch.randn(n, k) * 0.1, group_k, group_k or 1)
    w_s = w_s.t().contiguous().t()
    b = torch.randn(n).to(torch.bfloat16)
    out = fp8_gemm.fp8_linear(x, w_q, w_s, group_k, b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert_close(out, ref.fp8_linear(x, w_q, w_s, group_k, b), torch.bfloat16)


@pytest.mark.parametrize("n, k, group_k, cfg", [
    (37, 200, 32, Fp8GemvConfig(block_n=4, block_k=128)),  # ragged K, a ragged last group, N not a multiple
    (72, 256, 128, Fp8GemvConfig(block_n=8, block_k=256)),
    (40, 384, 128, Fp8GemvConfig(block_n=16, block_k=1024, num_warps=2)),  # one masked step of 8 groups
    (64, 512, 64, Fp8GemvConfig(block_n=8, block_k=256, num_warps=8)),
    (72, 256, 128, Fp8GemvConfig(block_n=8, block_k=256, half=False)),  # every product in float32
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_gemv_is_the_reference_layer(n, k, group_k, cfg, dtype, assert_close):
    # the CUDA-core GEMV quantises the row group by group as per_token_group_quant_fp8 does:
    # the reference layer's product (same codes and scales) up to summation order and, with
    # ``half``, runs of 16 products summed in float16
    x = (torch.randn(2, k) * torch.exp(torch.randn(2, 1) * 2)).to(dtype)
    x[0, :7] = 0  # a partly zero group
    w_q, w_s = ref.quantize_weight(torch.randn(n, k) * 0.1, group_k, 32)
    w_s = w_s.t().contiguous().t()
    b = torch.randn(n).to(dtype)
    out = fp8_gemv(x, w_q, w_s, group_k, cfg, b)
    assert out.dtype == dtype
    assert_close(out, ref.fp8_linear(x.float(), w_q, w_s, group_k, b.float()), dtype)
    assert_close(fp8_gemv(x[:1], w_q, w_s, group_k, cfg), ref.fp8_linear(x[:1].float(), w_q, w_s, group_k), dtype)
    # given the row's codes and scales (group-major, as the RMS norm writes them), the bits of quantising here
    codes, scales = ref.per_token_group_quant_fp8(x, group_k)
    scales = scales.t().contiguous().t()
    assert torch.equal(fp8_gemv(x, w_q, w_s, group_k, cfg, b, codes, scales), out)


def test_fp8_gemv_rejects_groups_it_cannot_step():
    w_q, w_s = ref.quantize_weight(torch.randn(8, 96), 48, 8)
    with pytest.raises(ValueError, match="scale group"):
        fp8_gemv(torch.randn(1, 96), w_q, w_s, 48, Fp8GemvConfig(block_n=8, block_k=96))
    w_q, w_s = ref.quantize_weight(torch.randn(8, 384), 128, 8)
    with pytest.raises(ValueError, match="power-of-two block_k"):  # three groups a step: no tl.arange
        fp8_gemv(torch.randn(1, 384), w_q, w_s, 128, Fp8GemvConfig(block_n=8, block_k=384))


def test_fp8_linear_takes_the_gemv_at_one_row(monkeypatch):
    # at GEMV_MAX_ROWS rows a block-scaled layer runs the GEMV with gemv_config's launch (the same
    # bits); where gemv_config gives none, the skinny kernel
    n, k = 72, 1024
    x = torch.randn(1, k).to(torch.bfloat16)
    w_q, w_s = ref.quantize_weight(torch.randn(n, k) * 0.1, 128, 128)
    cfg = fp8_configs.gemv_config(n, k, 128)
    assert cfg is not None and fp8_configs.GEMV_MAX_ROWS >= 1
    # layers past GEMV_MAX_WEIGHTS (Qwen3-8B's gate_up and down), per-channel weights and scale
    # groups a step cannot hold keep the skinny kernel
    assert fp8_configs.gemv_config(4096, 12288, 128) is None and fp8_configs.gemv_config(6144, 4096, 128) is not None
    assert fp8_configs.gemv_config(n, k, 0) is None and fp8_configs.gemv_config(n, k, 2048) is None
    out = fp8_gemm.fp8_linear(x, w_q, w_s, 128)
    assert torch.equal(out, fp8_gemv(x, w_q, w_s, 128, cfg))
    monkeypatch.setattr(fp8_gemm, "gemv_config", lambda n, k, g: None)
    skinny = skinny_gemm(x, w_q, None, skinny_config(n, k, 128), scales=(None, w_s, 128), out_dtype=x.dtype)
    assert torch.equal(fp8_gemm.fp8_linear(x, w_q, w_s, 128), skinny)


@pytest.mark.parametrize("m, k", [(1, 256), (3, 1024)])  # 1024 keys: split in two, SiLU-mul in the reduction
def test_fp8_gated_linear_fuses_up_to_its_row_count(m, k, monkeypatch, assert_close):
    # up to GATED_MAX_ROWS rows one gated skinny launch: the bits of the skinny kernel over the weight's rows
    # in the product's order (gate 0, up 0, gate 1, ...), then silu_and_mul; above it, or where the GEMV
    # takes the row, fp8_linear then silu_and_mul
    from atom.ops.reference import silu_and_mul as silu_and_mul_ref
    from atom.ops.triton.activation import silu_and_mul

    n = 2 * 40
    x = torch.randn(m, k).to(torch.bfloat16)
    w_q, w_s = ref.quantize_weight(torch.randn(n, k) * 0.1, 128, 128)
    w_s = w_s.t().contiguous().t()
    b = torch.randn(n).to(torch.bfloat16)
    monkeypatch.setattr(fp8_gemm, "gemv_config", lambda n, k, g: None)
    cfg = skinny_config(n, k, 128)
    assert cfg.split_k == (2 if k == 1024 else 1)
    order = torch.arange(n).view(2, n // 2).t().reshape(-1)
    product = skinny_gemm(x, w_q[order], b[order], cfg, scales=(None, w_s[order], 128), out_dtype=x.dtype)
    fused = silu_and_mul(torch.cat([product[:, 0::2], product[:, 1::2]], 1))
    unfused = silu_and_mul(fp8_gemm.fp8_linear(x, w_q, w_s, 128, b))
    monkeypatch.setattr(fp8_gemm, "GATED_MAX_ROWS", m)
    out = fp8_gemm.fp8_gated_linear(x, w_q, w_s, 128, b)
    assert out.shape == (m, n // 2) and out.dtype == torch.bfloat16
    assert torch.equal(out, fused)
    assert_close(out, silu_and_mul_ref(ref.fp8_linear(x.float(), w_q, w_s, 128, b.float())), torch.bfloat16)
    monkeypatch.setattr(fp8_gemm, "GATED_MAX_ROWS", m - 1)
    assert torch.equal(fp8_gemm.fp8_gated_linear(x, w_q, w_s, 128, b), unfused)
    monkeypatch.setattr(fp8_gemm, "GATED_MAX_ROWS", m)
    monkeypatch.setattr(fp8_gemm, "gemv_config", fp8_configs.gemv_config)  # the GEMV's row: no gated launch
    if m == 1:
        assert torch.equal(fp8_gemm.fp8_gated_linear(x, w_q, w_s, 128, b),
                           silu_and_mul(fp8_gemv(x, w_q, w_s, 128, fp8_configs.gemv_config(n, k, 128), b)))  # fmt: skip


@pytest.mark.parametrize("m", [1, 3, SKINNY_MAX_ROWS + 3])  # the GEMV's row, the skinny kernel, the tile GEMM
@pytest.mark.parametrize("gated", [False, True])
def test_fp8_linear_given_the_norms_codes(m, gated, monkeypatch):
    # the activation's codes and scales made before (the RMS norm's, per_token_group_quant_fp8's bits) read
    # instead of quantising x: the same output bits on every path, the gated skinny launch included
    n, k = 2 * 40, 256
    x = torch.randn(m, k).to(torch.bfloat16)
    w_q, w_s = ref.quantize_weight(torch.randn(n, k) * 0.1, 128, 128)
    w_s = w_s.t().contiguous().t()
    b = torch.randn(n).to(torch.bfloat16)
    monkeypatch.setattr(fp8_gemm, "GATED_MAX_ROWS", 3)
    op = fp8_gemm.fp8_gated_linear if gated else fp8_gemm.fp8_linear
    codes, scales = per_token_group_quant_fp8(x, 128)
    given = op(x, w_q, w_s, 128, b, None, codes, scales)
    assert torch.equal(given, op(x, w_q, w_s, 128, b))
    # the codes are read (not x) on every path, the one-row GEMV's included: zeroed codes change the output
    zeroed = op(x, w_q, w_s, 128, b, None, torch.zeros_like(codes), scales)
    assert not torch.equal(zeroed, given)
