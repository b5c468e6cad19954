"""The skinny GEMM behind ``atom.ops.linear`` at Qwen3 shapes on CUDA: against an fp32
product, inside a CUDA graph, and under torch.compile with a dynamic batch.

Run in its own pytest process (tests/kernels switches Triton to its interpreter)."""

import functools
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


# the split-K sums added by the last of a column block's programs (gemv.FOLD_SPLIT_K): the reduction kernel's
# bits at Qwen3-8B's gate_up (gated) and down, bf16 and FP8 (activations quantised in the kernel, first with
# the rows there are tiled to the MMA's, gemv.QUANT_ROWS_TILED: the same bits), 1-16 rows, the same bits again
# on a second launch (the counters zero again) and inside a CUDA graph replayed twice
@pytest.mark.parametrize("n,k,gated", [(2 * 12288, 4096, True), (4096, 12288, False)])
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("fp8", [False, True])
def test_split_k_folded(n, k, gated, m, fp8, monkeypatch):
    import dataclasses

    from atom.ops import reference_fp8
    from atom.ops.triton import counters, gemv
    from atom.ops.triton.fp8_configs import skinny_config

    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV) / k**0.5
    if fp8:
        w, w_scale = reference_fp8.quantize_weight(w, 128, 128)
        cfg, scales = skinny_config(n, k, 128), (None, w_scale.t().contiguous().t(), 128)
    else:
        w, scales = w.to(torch.bfloat16), None
        cfg = gemv.pick_config(m, n, k)
    cfg = dataclasses.replace(cfg, split_k=4, block_n=cfg.block_n + cfg.block_n % 2)
    run = functools.partial(gemv.skinny_gemm, x, w, None, cfg, scales=scales, out_dtype=torch.float32, gated=gated)
    reduced = run()
    if fp8:
        monkeypatch.setattr(gemv, "QUANT_ROWS_TILED", True)
        torch.testing.assert_close(run(), reduced, atol=0, rtol=0)
    monkeypatch.setattr(gemv, "FOLD_SPLIT_K", True)
    for _ in range(2):
        torch.testing.assert_close(run(), reduced, atol=0, rtol=0)
    assert not counters.launch_counters(x.device).any()
    out = torch.empty_like(reduced)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(run())
    for _ in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, reduced, atol=0, rtol=0)
