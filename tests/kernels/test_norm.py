import pytest
import torch

from atom.ops import reference
from atom.ops.triton import rms_norm


@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (3, 5, 256), (4, 1000)])
def test_rms_norm(shape, dtype, assert_close):
    x = torch.randn(shape, dtype=dtype)
    weight = 1 + 0.1 * torch.randn(shape[-1], dtype=dtype)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype
    assert_close(out, reference.rms_norm(x.float(), weight.float(), 1e-6), dtype, scale=2)
    # Same roundings as the reference in its own dtype: at most one ulp apart.
    assert_close(out, reference.rms_norm(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("shape", [(1, 64), (9, 320), (2, 3, 128)])
def test_rms_norm_residual(shape, dtype, assert_close):
    x = torch.randn(shape, dtype=dtype)
    residual = torch.randn(shape, dtype=dtype)
    weight = 1 + 0.1 * torch.randn(shape[-1], dtype=dtype)
    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_residual = reference.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(new_residual, ref_residual)
    assert_close(out, ref_out, dtype)


def test_rms_norm_strided_rows(assert_close):
    # A row slice of a wider tensor (e.g. part of a fused projection output).
    base = torch.randn(5, 200)
    x = base[:, :128]
    weight = torch.randn(128)
    assert_close(rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), torch.float32)


@pytest.mark.parametrize(("rows", "hidden", "residual"), [(1, 256, False), (5, 384, True), (0, 128, True)])
def test_rms_norm_fp8_codes_are_the_group_quantisation_of_its_output(rows, hidden, residual):
    # the codes and scales beside the output: per_token_group_quant_fp8 of that output, bit for bit
    from atom.ops.triton.fp8_gemm import per_token_group_quant_fp8
    from atom.ops.triton.norm import rms_norm_fp8

    x = torch.randn(rows, hidden, dtype=torch.bfloat16) * 3
    res = torch.randn(rows, hidden, dtype=torch.bfloat16) if residual else None
    weight = 1 + 0.1 * torch.randn(hidden, dtype=torch.bfloat16)
    out, new_res, codes, scales = rms_norm_fp8(x, weight, 1e-6, res, group_k=128)
    want = rms_norm(x, weight, 1e-6, res)
    assert torch.equal(out, want[0] if residual else want)
    assert new_res is None if not residual else torch.equal(new_res, want[1])
    want_codes, want_scales = per_token_group_quant_fp8(out, 128)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales) and scales.stride() == want_scales.stride()
