"""Tile tables of the FP8 kernels (``fp8_gemm``, ``moe_fp8``), picked per batch-size bucket
by ``tests/gpu/fp8_sweep.py`` on an H100 (docs/fp8.md has the measurements).

Each table is a list of (largest bucket value, config), first match wins. GEMM configs:
BLOCK_M, BLOCK_N, BLOCK_K (per-channel only: block scales step one 128-column group),
GROUP_M (launch-order swizzle), SPLIT_K (key-range split for small batches), num_warps,
num_stages. MoE configs: the same without GROUP_M / SPLIT_K, by pairs per expert."""

from __future__ import annotations

_INF = float("inf")

# by m (tokens); block-scaled (per_group) and per-channel weights
GEMM_BLOCK = [
    (16, dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=8, SPLIT_K=1, num_warps=4, num_stages=4)),
    (64, dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=8, SPLIT_K=1, num_warps=4, num_stages=4)),
    (_INF, dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, SPLIT_K=1, num_warps=4, num_stages=3)),
]
GEMM_CHANNEL = [
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, SPLIT_K=1, num_warps=4, num_stages=4)),
    (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, SPLIT_K=1, num_warps=4, num_stages=4)),
    (_INF, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=3)),
]

# by (token, expert) pairs per expert
MOE_BLOCK = [
    (16, dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=3)),
    (32, dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3)),
    (_INF, dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3)),
]
MOE_CHANNEL = [
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)),
    (32, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)),
    (_INF, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)),
]


def _pick(table: list[tuple[float, dict]], value: float) -> dict:
    return next(cfg for limit, cfg in table if value <= limit)


def gemm_config(m: int, n: int, k: int, per_group: bool) -> dict:
    return _pick(GEMM_BLOCK if per_group else GEMM_CHANNEL, m)


def moe_config(pairs_per_expert: float, per_group: bool) -> dict:
    return _pick(MOE_BLOCK if per_group else MOE_CHANNEL, pairs_per_expert)
