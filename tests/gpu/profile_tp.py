"""Where a tensor-parallel step's GPU time goes: the throughput workload on ``-tp N``, rank 0's
torch-profiler trace over a window of steps, its kernels summed by kind (GEMM, attention,
all-reduce, MoE, norm/rope/activation, the rest), and how much of the window the GPU was busy.

    PYTHONPATH=. python tests/gpu/profile_tp.py qwen3-8b --run 2 --run 1 --run 2:0 --steps 300:340

One engine per ``--run TP[:LEVEL]`` in turn (LEVEL: the compilation level, default 3), the same
workload; traces under $OUT/prof_tpTP_lLEVEL. ``--batch-1`` profiles one request instead (a
32-token prompt, 512 tokens out): the batch-1 decode step of ``benchmark_latency``.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import random
import re
from collections import defaultdict

KINDS = [  # first match wins
    ("all-reduce", r"nccl|all_reduce|allreduce|one_shot|symm|cross_device"),
    ("attention", r"attn|attention|flash|paged|decode_kernel|merge"),
    ("moe", r"moe|expert|fused_experts|align|topk"),
    ("gemm", r"gemm|gemv|sm90_xmma|cutlass|cublas|nvjet|matmul|_mm_|wgmma"),
    ("norm/rope/act", r"norm|rope|rotary|silu|gelu|act_and_mul"),
    ("sampling", r"sampl|argmax|softmax|gumbel|philox"),
]


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, pat in KINDS if re.search(pat, low)), "other")


def summarise(trace_path: str) -> dict:
    """Kernel time by kind and the GPU's busy fraction of the window (union of kernel intervals)."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    by_kind, by_name = defaultdict(float), defaultdict(float)
    for e in kernels:
        by_kind[kind(e["name"])] += e["dur"]
        by_name[e["name"][:70]] += e["dur"]
    busy, end = 0.0, float("-inf")
    for e in sorted(kernels, key=lambda e: e["ts"]):
        lo, hi = max(e["ts"], end), e["ts"] + e["dur"]
        busy += max(0.0, hi - lo)
        end = max(end, hi)
    span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) if kernels else 0.0
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return dict(span_ms=span / 1e3, busy_ms=busy / 1e3, kinds={k: v / 1e3 for k, v in by_kind.items()},
                top=[(n, v / 1e3) for n, v in top])


def run(model: str, spec: str, window: tuple[int, int], out: str, batch_1: bool) -> dict:
    from atom import LLMEngine, SamplingParams
    from atom.benchmarks.benchmark_throughput import workload
    from atom.benchmarks.model_configs import model_dir

    tp, level = (int(x) for x in (spec + ":3").split(":")[:2])
    prof_dir = f"{out}/prof_tp{tp}_l{level}"
    llm = LLMEngine(model_dir(model), load_dummy=True, skip_tokenizer_init=True, max_model_len=4096,
                    tensor_parallel_size=tp, level=level, torch_profiler_dir=prof_dir)
    random.seed(0)
    prompts, max_tokens = ([list(range(1, 33))], [512]) if batch_1 else workload(256, 1024, 1024)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)
    llm.add_request(prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens])
    step = 0
    while not llm.is_finished():
        if step == window[0]:
            llm.start_profile()
        llm.step()
        step += 1
        if step == window[1]:
            llm.stop_profile()
    llm.shutdown()
    traces = sorted(glob.glob(f"{prof_dir}/**/*.json*", recursive=True))
    rank0 = [t for t in traces if "rank_0" in t] or traces
    return summarise(rank0[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--run", action="append", help="TP[:LEVEL], one engine each (default 2)")
    p.add_argument("--steps", default="300:340", help="the profiled window of engine steps, FIRST:LAST")
    p.add_argument("--batch-1", action="store_true", help="one request (batch-1 decode) instead of the workload")
    args = p.parse_args()
    out = os.environ.get("OUT", "gpu-results")
    window = tuple(int(x) for x in args.steps.split(":"))
    results = {spec: run(args.model, spec, window, out, args.batch_1) for spec in args.run or ["2"]}
    json.dump(results, open(f"{out}/profile_tp.json", "w"), indent=1)
    for tp, r in results.items():
        print(f"\n{tp} (tp:level): top kernels (ms over the window)")
        for name, ms in r["top"]:
            print(f"  {ms:8.2f}  {name}")
    kinds = sorted({k for r in results.values() for k in r["kinds"]})
    print("\n| tp:level | window ms | GPU busy ms | " + " | ".join(kinds) + " |\n|" + "---|" * (len(kinds) + 3))
    for tp, r in results.items():
        cells = " | ".join(f"{r['kinds'].get(k, 0):.1f}" for k in kinds)
        print(f"| {tp} | {r['span_ms']:.1f} | {r['busy_ms']:.1f} | {cells} |")


if __name__ == "__main__":
    main()
