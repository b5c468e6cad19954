"""The op table of ``atom.ops``: every op has a reference, a Triton kernel that imports, and
a custom-op schema; ops dispatch to the reference on the CPU."""

import inspect
import re

import pytest
import torch

from atom import ops


@pytest.mark.parametrize("name", sorted(ops._OPS))
def test_every_op_has_a_kernel_and_a_schema(name):
    spec = ops._OPS[name]
    assert callable(ops._kernel(spec))
    schema = torch.library.infer_schema(spec.reference, mutates_args=spec.mutates)
    for arg in spec.mutates:
        assert re.search(rf"Tensor\(a\d+!\)\?? {arg}\b", schema), (arg, schema)  # written in place
    # the custom op calls the kernel with the schema's arguments in the reference's order:
    # the kernel must take them in that order (extra kernel-only arguments come after)
    ref_params = list(inspect.signature(spec.reference).parameters)
    kernel_params = list(inspect.signature(ops._kernel(spec)).parameters)
    assert kernel_params[: len(ref_params)] == ref_params, (ref_params, kernel_params)


def test_public_ops_are_registered_and_run_the_reference_on_cpu():
    assert {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "paged_attention", "fused_moe"} <= set(ops._OPS)
    x, w = torch.randn(3, 8), torch.randn(8)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ops.reference.rms_norm(x, w, 1e-6))
    out, res = ops.rms_norm(x, w, 1e-6, residual=x)
    torch.testing.assert_close(res, 2 * x)
    with pytest.raises(ValueError, match="registered twice"):
        ops.register_op("silu_and_mul", triton="x:y", fake=lambda x: x)(ops.reference.silu_and_mul)


def test_reference_ops_compile_as_opaque_custom_ops_on_cpu():
    """Off CUDA, a compiled graph calls the references as custom ops: Dynamo traces a model
    with the MoE reference's data-dependent loop in one graph, with the eager result."""
    ops.init_device_ops("cpu")
    torch.manual_seed(0)
    x, w13, w2, router = torch.randn(5, 8), torch.randn(4, 6, 8), torch.randn(4, 8, 3), torch.randn(5, 4)

    def moe_block(x, router):
        weights, ids = ops.moe_topk(router, 2, True)
        return ops.rms_norm(ops.fused_moe(x, w13, w2, weights, ids), torch.ones(8), 1e-6)

    compiled = torch.compile(moe_block, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, router), moe_block(x, router))


def test_gated_linear_is_silu_and_mul_of_the_linear_on_cpu():
    # the MLP's gate / up op (one launch at decode sizes on CUDA): on the CPU, also compiled (its fake
    # tensor's shape: half the weight's rows)
    ops.init_device_ops("cpu")
    x, w, b = torch.randn(2, 3, 8), torch.randn(10, 8), torch.randn(10)
    ref = ops.reference.silu_and_mul(torch.nn.functional.linear(x, w, b))
    torch.testing.assert_close(ops.gated_linear(x, w, b), ref)
    compiled = torch.compile(lambda x: ops.gated_linear(x, w, b).reshape(6, 5), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), ref.reshape(6, 5))


def test_fp8_gated_linear_is_silu_and_mul_of_the_fp8_linear_on_cpu():
    # the FP8 MLP's gate / up op: on the CPU the reference layer then SiLU-mul, also compiled (half the rows)
    from atom.ops import reference_fp8

    ops.init_device_ops("cpu")
    x = torch.randn(3, 256)
    w_q, w_s = reference_fp8.quantize_weight(torch.randn(10, 256) * 0.1, 128, 128)
    ref = ops.reference.silu_and_mul(reference_fp8.fp8_linear(x, w_q, w_s, 128))
    torch.testing.assert_close(ops.fp8_gated_linear(x, w_q, w_s, 128), ref, atol=0, rtol=0)
    compiled = torch.compile(lambda x: ops.fp8_gated_linear(x, w_q, w_s, 128) * 2, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), ref * 2)


def test_the_norm_writing_fp8_codes_feeds_the_fp8_linear_on_cpu():
    # fused_add_rms_norm_fp8: the norm, the summed residual, and the normed rows' codes and group scales
    # (per_token_group_quant_fp8's); the FP8 linear given them computes what it computes from the normed rows;
    # compiled, the fake tensors' shapes and layouts carry through
    from atom.ops import reference_fp8

    ops.init_device_ops("cpu")
    x, res, w = torch.randn(3, 256), torch.randn(3, 256), 1 + 0.1 * torch.randn(256)
    w_q, w_s = reference_fp8.quantize_weight(torch.randn(10, 256) * 0.1, 128, 128)

    def block(x, res):
        out, summed, codes, scales = ops.fused_add_rms_norm_fp8(x, w, 1e-6, res, 128)
        return ops.fp8_gated_linear(out, w_q, w_s, 128, None, None, codes, scales), summed, scales

    normed, summed = ops.rms_norm(x, w, 1e-6, res)
    want = ops.fp8_gated_linear(normed, w_q, w_s, 128)
    got, got_summed, scales = block(x, res)
    assert torch.equal(got, want) and torch.equal(got_summed, summed)
    assert scales.shape == (3, 2) and scales.stride() == (1, 3)  # group-major, as the kernels write them
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(x, res), (want, summed, scales)):
        assert torch.equal(a, b)
