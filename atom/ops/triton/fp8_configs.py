"""Tile tables of the FP8 kernels (``fp8_gemm``, ``moe_fp8``), picked per batch-size bucket
by ``tests/gpu/fp8_sweep.py`` on an H100 (the candidate with the lowest geometric-mean time
over the Qwen3-8B / Qwen3-30B-A3B shapes; docs/fp8.md has the measurements).

Each table is a list of (largest bucket value, config), first match wins. GEMM configs:
BLOCK_M, BLOCK_N, BLOCK_K (per-channel only: block scales step one 128-column group),
GROUP_M (launch-order swizzle), SPLIT_K (key-range split for small batches), num_warps,
num_stages. MoE configs: the same without GROUP_M / SPLIT_K, by pairs per expert; ``down``
overrides keys for the down GEMM."""

from __future__ import annotations

from atom.ops.triton.fp8_gemv import Fp8GemvConfig
from atom.ops.triton.gemv import GemvConfig
from atom.ops.triton.moe_gemv import MoeGemvConfig

_INF = float("inf")

# by m (tokens); block-scaled (per_group) and per-channel weights. Small batches are bound
# by reading the weights: narrow column tiles and a 4-way key split fill the GPU.
GEMM_BLOCK = [
    (16, dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=8, SPLIT_K=4, num_warps=4, num_stages=4)),
    (64, dict(BLOCK_M=64, BLOCK_N=32, GROUP_M=8, SPLIT_K=2, num_warps=4, num_stages=4)),
    (_INF, dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, SPLIT_K=1, num_warps=4, num_stages=3)),
]
GEMM_CHANNEL = [
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, SPLIT_K=1, num_warps=4, num_stages=5)),
    (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, SPLIT_K=1, num_warps=4, num_stages=4)),
    (256, dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, SPLIT_K=1, num_warps=4, num_stages=4)),
    (1024, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=3)),
    (_INF, dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=3)),
]

# by (token, expert) pairs per expert (Qwen3-30B-A3B: tokens / 16)
# block-128 weights: from 512 tokens of Qwen3-30B-A3B-FP8 (32 rows per expert) the down GEMM's 128-column
# tile is 12-16% faster (H200, session 29, `kernel_sweep.py moe_fp8`; 16-row tiles stay best to 128 tokens).
# Session 30 (same sweep): ``paired`` (gate and up in one dot: the gated GEMM's wgmma as wide as vLLM's and
# no spills) 16% faster at 2,048 tokens, the row tiles in groups of 8 2-4% and 3 stages 1-3% more; neutral
# on the 16-row tiles. Not for MOE_CHANNEL's 128x128 tile: paired, it spills in the key loop (sm_90 build).
# Session 31: the 16-row tiles in groups of 16 (vLLM's GROUP_SIZE_M at 4-96 tokens) 1-2% at 128 tokens.
# Session 32: the 64-row tile from 16 rows per expert, as vLLM's table from 256 tokens (0.2120 vs 0.2186 ms at
# 256 tokens; 0.2072 vs 0.1896 at 128, so 8 rows keep the 16-row tile); end to end 1.035x vLLM (7,572.8 vs 7,317.2).
MOE_BLOCK = [
    (8, dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=3, GROUP_M=16, paired=True)),
    (_INF, dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, GROUP_M=8, paired=True, down=dict(BLOCK_N=128))),
]
MOE_CHANNEL = [
    (32, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3)),
    (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)),
    (128, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)),
    (_INF, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, down=dict(BLOCK_N=256))),
]


def _pick(table: list[tuple[float, dict]], value: float) -> dict:
    return next(cfg for limit, cfg in table if value <= limit)


# A grid this large already fills the GPU (4 programs per SM of an H100's 132)
_FULL_GRID = 512


def gemm_config(m: int, n: int, k: int, per_group: bool) -> dict:
    cfg = _pick(GEMM_BLOCK if per_group else GEMM_CHANNEL, m)
    tiles = -(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"])
    if cfg["SPLIT_K"] > 1 and tiles >= _FULL_GRID:
        # wide layers (Qwen3-8B's gate_up, n = 24576): no key split, 64-column tiles
        # (m = 1: 51 us vs 57 us with the split; m = 64: 51 us vs 67 us)
        return {**cfg, "BLOCK_N": 64, "SPLIT_K": 1}
    return cfg


# Up to this many rows, and this many output columns, the block-scaled and per-channel GEMMs
# take the skinny kernel (atom.ops.triton.gemv): a decode step only streams the weight, and
# with block scales the kernel quantises the activations itself (fp8_gemm.fp8_linear: no
# quantisation launch, ~5 us a layer at one row). H200 sweep (tests/gpu/fp8_gemm_probe.py
# --sweep, 2026-11-26, session 10), us at 1 / 4 / 16 rows, skinny vs the tile kernel:
# qkv 12.4 / 12.4 / 12.4 vs 15.3 / 15.5 / 16.0; o 10.3 / 10.3 / 10.4 vs 13.1 / 13.3 / 13.6;
# down 20.6 / 20.8 / 21.1 vs 25.5 / 25.8 / 26.5; gate_up (24,576 columns) 33.5 / 33.4 / 33.9
# vs 34.2 / 34.4 / 34.8 (with 8 warps and no split 32.5: not in the rule below).
SKINNY_MAX_ROWS = 16
SKINNY_MAX_N = 24576


def skinny_config(n: int, k: int, group_k: int) -> GemvConfig:
    """The skinny kernel's launch for every row count up to ``SKINNY_MAX_ROWS`` (one compiled
    variant: the rows pad to 16): a program's weight rows as the MMA's long side ("swap AB";
    128 rows where N and K are 4,096 or more, as swept, else 64), one 128-column scale group
    per key step, and the key range split in two until the grid fills the GPU or a split
    would get fewer than 8 key steps (4 with 64 rows). Unrolling several scale groups per
    loop iteration (tried in the same sweep) did not pay. The 128-row programs run 8 warps and
    3 stages: between the norms and the other GEMMs of a decode step (tests/gpu/decode_chain.py
    --variants, H200, session 32: Qwen3-8B-FP8's layer minus attention at one row 89.5 us against
    107.0 with 4 warps and 4 stages; 2, 4 or 6 stages, or fewer splits, slower)."""
    block_n = 128 if n >= 4096 and k >= 4096 else 64
    block_k = group_k or 128
    programs, steps = -(-n // block_n), -(-k // block_k)
    min_steps = 8 if block_n == 128 else 4
    split = 1
    while split < 8 and programs * split * 2 <= _FULL_GRID and steps >= split * 2 * min_steps:
        split *= 2
    wide = block_n == 128
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split, mode="dot_t", num_warps=8 if wide else 4,
                      num_stages=3 if wide else 4)  # fmt: skip


# Up to this many rows a block-scaled FP8 linear runs the CUDA-core GEMV (atom.ops.triton.fp8_gemv)
# where ``gemv_config`` gives it a launch (0: never, the skinny kernel at every row count)
GEMV_MAX_ROWS = 1
GEMV_MAX_WEIGHTS = 1 << 25


def gemv_config(n: int, k: int, group_k: int) -> Fp8GemvConfig | None:
    """The CUDA-core FP8 GEMV's launch for an [1, k] x [n, k]^T product with ``group_k``-column
    scale groups, or None where the skinny kernel runs instead. H200, session 33 (`decode_chain.py
    --gemms`, Qwen3-8B's four GEMMs at one row, us): the GEMV wins on layers of up to 32 M weights
    (qkv 13.6 against the skinny kernel's 15.3, o 11.2 against 12.8: 16 rows a program, 1,024 keys a
    step, 4 warps) and loses on larger ones (gate_up 38.6-59.3 against 35.6, down 22.8-38.9 against
    21.9), where the skinny kernel's splits keep more loads in flight."""
    if not group_k or 1024 % group_k or n * k > GEMV_MAX_WEIGHTS:
        return None
    return Fp8GemvConfig(block_n=16, block_k=1024, num_warps=4, num_stages=2)


def moe_config(pairs_per_expert: float, per_group: bool) -> dict:
    return _pick(MOE_BLOCK if per_group else MOE_CHANNEL, pairs_per_expert)


# Up to this many tokens, and experts of up to this many weights (gate, up and down), the block-scaled FP8
# MoE runs the CUDA-core GEMVs (atom.ops.triton.moe_gemv): no sort or quantisation launches, and no
# 16-row tiles holding one real row an expert (0 tokens: never). H200, session 35 (`kernel_sweep.py
# moe_fp8_gemv`, us, GEMV / tiles / vLLM's fused_experts): Qwen3-30B-A3B-FP8's experts (4.7 M weights) at
# 1 token 23.7 / 40.4 / 29.4, 2 tokens 38.4 / 48.0 / 39.2, 4 tokens 65.7 / 65.4 / 58.5; DeepSeek-V3's
# (44 M) at 1 token 151.6 / 138.8 / 119.2, where the GEMV streams the larger experts slower. H100, session
# 36 (the same sweep, GEMV / tiles): DeepSeek-V2-Lite's experts (8.65 M) 34.4 / 49.6 at 1 token, 57.8 / 64.6
# at 2; Qwen3-235B-A22B's (18.9 M) 76.2 / 87.1, 139.9 / 144.1; DeepSeek-V3's 171.9 / 172.8: the limit of the
# bf16 MoE's GEMVs (33.5 M), V3's experts on the tiles.
MOE_GEMV_MAX_TOKENS = 2
MOE_GEMV_MAX_EXPERT_WEIGHTS = 1 << 25


def moe_gemv_config(num_tokens: int, hidden: int, inter: int, group_k: int) -> MoeGemvConfig | None:
    """The FP8 MoE's GEMV launches at ``num_tokens`` of experts [2 x inter, hidden] / [hidden, inter], or
    None where the tile kernels run. Session 35's sweep: 8 gate / up rows a program over 1,024 keys a
    step (4 warps) and 8 down rows over 256 keys (2 warps) fastest of 7 launches at 1, 2, 8 and 16 tokens
    (session 34's 16 gate / up rows: 25.6 us at 1 token, 42.5 at 2)."""
    if num_tokens > MOE_GEMV_MAX_TOKENS or 3 * hidden * inter > MOE_GEMV_MAX_EXPERT_WEIGHTS or not group_k:
        return None
    if 128 % group_k:  # scale groups the down GEMV's 256-key steps cannot hold
        return None
    return MoeGemvConfig(Fp8GemvConfig(block_n=8, block_k=1024), Fp8GemvConfig(block_n=8, block_k=256, num_warps=2))
