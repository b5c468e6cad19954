"""The skinny GEMM behind ``atom.ops.linear`` at Qwen3 shapes on CUDA: against an fp32
product, inside a CUDA graph, and under torch.compile with a dynamic batch.

Run in its own pytest process (tests/kernels switches Triton to its interpreter)."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton", allow_module_level=True)

from atom import ops  # noqa: E402
from atom.ops.triton.gemv import MAX_ROWS, WIDE_MAX_ROWS, WIDE_N  # noqa: E402

DEV = "cuda"
ops.init_device_ops(torch.device(DEV))  # register the custom ops before torch.compile traces one
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def assert_close(out, ref, dtype):
    err = (out.double() - ref.double()).abs().max().item()
    assert err <= TOLERANCE[dtype] * max(1.0, ref.abs().max().item()), f"max abs error {err}"


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288), (1024, 2048), (1000, 1000), (WIDE_N + 100, 1024)])
@pytest.mark.parametrize("m", [1, 2, 3, 17, WIDE_MAX_ROWS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_real_shapes(n, k, m, dtype):
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    w = torch.randn(n, k, device=DEV, dtype=dtype) / k**0.5
    bias = torch.randn(n, device=DEV, dtype=dtype)
    out = ops.linear(x, w, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, F.linear(x.float(), w.float(), bias.float()), dtype)


def test_linear_in_cuda_graph():
    w = torch.randn(4096, 4096, device=DEV, dtype=torch.bfloat16) / 64
    x = torch.randn(4, 4096, device=DEV, dtype=torch.bfloat16)
    ops.linear(x, w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.linear(x, w)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, ops.linear(x, w), atol=0, rtol=0)


def test_linear_compiled_dynamic_batch():
    w = torch.randn(1024, 512, device=DEV, dtype=torch.bfloat16) / 23
    bias = torch.randn(1024, device=DEV, dtype=torch.bfloat16)
    fn = torch.compile(lambda x: ops.linear(x, w, bias) * 2, dynamic=True, fullgraph=True)
    for m in (MAX_ROWS, MAX_ROWS + 1, 40):
        x = torch.randn(m, 512, device=DEV, dtype=torch.bfloat16)
        torch.testing.assert_close(fn(x), ops.linear(x, w, bias) * 2, atol=0, rtol=0)


# the activation in the skinny kernel's epilogue (gemv.gated_linear) at Qwen3-8B's and 0.6B's gate_up, with
# its one-row launch and with key splits: the bits of the GEMM over the weight's rows in the kernel's order
# (gate 0, up 0, gate 1, ...) then silu_and_mul, and near the fp32 product
@pytest.mark.parametrize("n,k", [(2 * 12288, 4096), (2 * 3072, 1024)])
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gated_skinny_gemm(n, k, split_k, dtype):
    import dataclasses

    from atom.ops.triton import gemv

    x = torch.randn(1, k, device=DEV, dtype=dtype)
    w = torch.randn(n, k, device=DEV, dtype=dtype) / k**0.5
    cfg = dataclasses.replace(gemv.pick_config(1, n, k), split_k=split_k)
    cfg = dataclasses.replace(cfg, block_n=cfg.block_n + cfg.block_n % 2)
    out = gemv.skinny_gemm(x, w, None, cfg, gated=True)
    order = torch.arange(n, device=DEV).view(2, n // 2).t().reshape(-1)
    product = gemv.skinny_gemm(x, w[order], None, cfg)
    unfused = ops.silu_and_mul(torch.cat([product[:, 0::2], product[:, 1::2]], 1))
    torch.testing.assert_close(out, unfused, atol=0, rtol=0)
    assert_close(out, ops.reference.silu_and_mul(F.linear(x.float(), w.float())), dtype)
