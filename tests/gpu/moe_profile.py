"""Where the fused MoE's time goes at decode sizes: per-kernel device times (torch profiler over CUDA-graph
replays of ``atom.ops.triton.fused_moe`` on ``kernel_bench.moe_case`` inputs), the gated and the down GEMM
told apart by launch order, for the default tiles and a few alternatives. GPU only:

    python tests/gpu/moe_profile.py [--fp8 [--tokens 1,512,2048,8192] [--sort-blocks 1024,4096]]

One line per (shape, tiles): the sum a call and each kernel's share, in us (a kernel launched twice a call,
as the two GEMMs, numbered by launch order). Shapes: 1, 2 and 4 tokens of Qwen3-30B-A3B's experts, one
token of DeepSeek-V2-Lite's and of DeepSeek-V3's. ``--fp8``: Qwen3-30B-A3B-FP8's experts (block-128
weights), atom's ``fused_moe_fp8`` and vLLM's FP8 ``fused_experts`` (``kernel_bench.moe_fp8_case``)
kernel by kernel, where vLLM is importable; ``--sort-blocks``: atom again with each ``moe.SORT_BLOCK`` (the
pairs a step of the sort's loops).
"""

from __future__ import annotations

import argparse
import collections
import functools

import torch

# tests/gpu/kernel_bench.py: python puts this script's directory on sys.path
from kernel_bench import captured, moe_case, moe_fp8_case, prepare

from atom.ops.triton import moe


def tiles(bn, bk, warps, stages, down_bn, down_bk, down_warps, down_stages=4) -> dict:
    down = dict(BLOCK_N=down_bn, BLOCK_K=down_bk, num_warps=down_warps, num_stages=down_stages)
    return dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, b_desc=True, down=down)


CONFIGS = [None, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)]  # the default, the 4-row tile
CONFIGS += [tiles(16, 128, 4, 4, 32, 128, 4), tiles(32, 128, 4, 4, 64, 256, 4, 3), tiles(16, 128, 2, 4, 32, 128, 2)]
CONFIGS += [tiles(32, 256, 4, 3, 16, 128, 2)]
SHAPES = [(1, {}), (2, {}), (4, {}), (1, dict(inter=1408, num_experts=64, top_k=6))]
SHAPES += [(1, dict(hidden=7168, inter=2048, num_experts=256, top_k=8))]


def kernel_times(fns, reps: int = 50) -> dict[str, float]:
    """Mean device time of each kernel a call, in us."""
    graph = captured(fns)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)  # fmt: skip
    calls = reps * len(fns)
    names = [e.name.split("(")[0].split("<")[0][:40] for e in events]
    per_call = {name: n // calls for name, n in collections.Counter(names).items()}
    total, seen = collections.Counter(), collections.Counter()
    for name, e in zip(names, events):
        if per_call[name] > 1:  # a kernel launched several times a call (the two GEMMs): by launch order
            seen[name] += 1
            name = f"{name} #{(seen[name] - 1) % per_call[name] + 1}"
        total[name] += e.device_time
    return {name: t / calls for name, t in total.most_common()}


def label(cfg: dict | None) -> str:
    if cfg is None:
        return "default"
    d, loads = {**cfg, **cfg.get("down", {})}, " desc" if cfg.get("b_desc") else ""
    down = f"{d['BLOCK_N']}/{d['BLOCK_K']}/w{d['num_warps']}"
    return f"{cfg['BLOCK_N']}/{cfg['BLOCK_K']}/w{cfg['num_warps']} down {down}{loads}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fp8", action="store_true", help="the FP8 MoE (block-128 weights) and vLLM's, by tokens")
    parser.add_argument("--tokens", default="1,512,2048,8192", help="with --fp8: token counts")
    parser.add_argument("--sort-blocks", default="", help="with --fp8: atom with these moe.SORT_BLOCK values too")
    args = parser.parse_args()
    if args.fp8:
        default_block = moe.SORT_BLOCK
        blocks = [int(b) for b in args.sort_blocks.split(",") if b]
        for tokens in map(int, args.tokens.split(",")):
            fns, refs, _, _ = prepare(functools.partial(moe_fp8_case, tokens))
            runs = [("atom", fns, default_block)] + [(f"sb={b}", fns, b) for b in blocks]
            for engine, calls, block in runs + [("vllm", refs.get(""), default_block)]:
                if calls:
                    moe.SORT_BLOCK = block  # read at capture
                    try:
                        times = kernel_times(calls)
                    finally:
                        moe.SORT_BLOCK = default_block
                    parts = " | ".join(f"{k} {v:7.2f}" for k, v in times.items())
                    print(f"fp8 T={tokens:<5} {engine:<7} {sum(times.values()):8.2f} us | {parts}")
            del fns, refs
            torch.cuda.empty_cache()
        return
    default = moe._gemm_config
    for tokens, experts in SHAPES:
        fns, _, nbytes, _ = prepare(functools.partial(moe_case, tokens, **experts))
        shape = f"T={tokens} E={experts.get('num_experts', 128)} ({nbytes / 1e6:.0f} MB)"
        for cfg in CONFIGS:
            moe._gemm_config = default if cfg is None else (lambda *_, c=cfg: c)
            try:
                times = kernel_times(fns)
                parts = " | ".join(f"{k} {v:6.2f}" for k, v in times.items())
                print(f"{shape:<22} {label(cfg):<34} {sum(times.values()):7.2f} us | {parts}")
            finally:
                moe._gemm_config = default
        del fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
