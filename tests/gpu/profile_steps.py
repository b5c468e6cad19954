"""Where a step's GPU time goes, for atom and vLLM: the throughput workload (or one request,
``--batch-1``), a torch-profiler trace over a window of engine steps, its kernels summed by kind
(GEMM, attention, all-reduce, MoE, norm/RoPE/activation, sampling, the rest) and how much of the
window the GPU was busy (the rest: host gaps).

    PYTHONPATH=. python tests/gpu/profile_steps.py qwen3-8b --run atom:1 --run vllm:1 --steps 300:330
    PYTHONPATH=. python tests/gpu/profile_steps.py qwen3-8b --run atom:2 --run atom:2:0   # -tp 2, level 3 / 0

A run is ``ENGINE:TP[:LEVEL]`` (LEVEL: atom's compilation level, default 3); one engine per
process is safest (an engine's memory outlives it in the process). atom profiles through its
own ``start_profile`` (rank 0's trace under -tp); vLLM on one GPU runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) under ``torch.profiler``, on several GPUs with its own
worker profiler (``profiler_config``, rank 0's trace). Traces in $OUT.
"""
from __future__ import annotations

import argparse
import bisect
import glob
import gzip
import json
import os
import random
import re
import time
from collections import defaultdict

from atom import SamplingParams
from atom.benchmarks.benchmark_throughput import workload
from atom.benchmarks.model_configs import model_dir, redraw_dummy_weights

KINDS = [  # first match wins
    ("all-reduce", r"nccl|all_reduce|allreduce|one_shot|symm|cross_device"),
    # atom's Gluon kernels too (_prefill_gluon_kernel, _mla_decode_gluon_kernel), and the MLA prompt attention
    ("attention", r"attn|attention|flash|paged|decode_kernel|merge|_gluon_kernel|mla_prefill"),
    ("fp8 quant", r"quant"),  # the GEMM inputs' e4m3 quantisation (atom's _group_quant_kernel, vLLM's)
    ("moe", r"moe|expert|fused_experts|align|topk"),
    ("gemm", r"gemm|gemv|sm90_xmma|cutlass|cublas|nvjet|matmul|_mm_|wgmma"),
    ("norm/rope/act", r"norm|rope|rotary|silu|gelu|act_and_mul|reshape_and_cache|triton_"),
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
                top=[(n, v / 1e3) for n, v in top], host=host_view(events, kernels))


def host_view(events: list[dict], kernels: list[dict], min_gap_us: float = 50.0) -> dict:
    """What the host did while the GPU idled: launches by kind (a graph replay or single kernels)
    and the host ops and annotations overlapping the GPU's idle gaps of at least ``min_gap_us``,
    summed by name (nested ops each count)."""
    launches = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cuda_runtime" and re.search(r"launch|graph", e.get("name", ""), re.I):
            launches[e["name"]][0] += 1
            launches[e["name"]][1] += e.get("dur", 0) / 1e3
    gaps, end = [], None
    for e in sorted(kernels, key=lambda e: e["ts"]):
        if end is not None and e["ts"] - end >= min_gap_us:
            gaps.append((end, e["ts"]))
        end = max(end or e["ts"], e["ts"] + e["dur"])
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function") and "dur" in e]
    long_ops = [e for e in host if e["dur"] > 5e3]  # checked against every gap; the rest by start time
    short = sorted((e for e in host if e["dur"] <= 5e3), key=lambda e: e["ts"])
    starts = [e["ts"] for e in short]
    in_gaps = defaultdict(float)
    for a, b in gaps:
        for e in long_ops + short[bisect.bisect_left(starts, a - 5e3):bisect.bisect_left(starts, b)]:
            overlap = min(b, e["ts"] + e["dur"]) - max(a, e["ts"])
            if overlap > 0:
                in_gaps[e["name"][:80]] += overlap / 1e3
    return dict(launches={k: v for k, v in sorted(launches.items(), key=lambda kv: -kv[1][1])},
                gaps=len(gaps), gap_ms=sum(b - a for a, b in gaps) / 1e3,
                in_gaps=sorted(in_gaps.items(), key=lambda kv: -kv[1])[:25])


def atom_run(model: str, tp: int, level: int, prompts, params, window, out: str) -> str:
    from atom import LLMEngine

    prof_dir = f"{out}/prof_atom_tp{tp}_l{level}"
    llm = LLMEngine(model_dir(model), load_dummy=True, skip_tokenizer_init=True, max_model_len=4096,
                    tensor_parallel_size=tp, level=level, torch_profiler_dir=prof_dir)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)
    llm.add_request(prompts, [SamplingParams(**p) for p in params])
    for step in range(window[1]):  # the rest of the workload is not needed
        if step == window[0]:
            llm.start_profile()
        llm.step()
    llm.stop_profile()
    llm.shutdown()
    traces = sorted(glob.glob(f"{prof_dir}/**/*.json*", recursive=True))
    return ([t for t in traces if "rank_0" in t] or traces)[0]


def vllm_run(model: str, tp: int, prompts, params, window, out: str, python: bool = False) -> str:
    """One GPU: in-process under ``torch.profiler`` (one profiler sees the model). Several:
    vLLM's own worker profiler (``profiler_config``), rank 0's trace."""
    import torch

    if tp == 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm import SamplingParams as VParams

    prof_dir = os.path.abspath(f"{out}/prof_vllm_tp{tp}")
    extra = {} if tp == 1 else dict(profiler_config=dict(profiler="torch", torch_profiler_dir=prof_dir,
                                                         torch_profiler_with_stack=False))
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the callable below, to the workers
    llm = LLM(model_dir(model), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              tensor_parallel_size=tp, **extra)
    llm.collective_rpc(redraw_dummy_weights)  # atom's weight distribution: see the function
    engine = llm.llm_engine
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], VParams(max_tokens=8, detokenize=False), use_tqdm=False)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, VParams(detokenize=False, **p))
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                              torch.profiler.ProfilerActivity.CUDA])
    if python:  # the host's Python functions over the window instead (one GPU)
        return python_profile(engine, window, out)
    for step in range(window[1]):
        if step == window[0]:
            prof.start() if tp == 1 else llm.start_profile()
        engine.step()
    if tp > 1:
        llm.stop_profile()
        for _ in range(120):  # the workers write their traces as they stop profiling
            traces = sorted(glob.glob(f"{prof_dir}/**/*.json*", recursive=True))
            if len(traces) >= tp:
                break
            time.sleep(1)
        time.sleep(5)
        return ([t for t in traces if "rank0" in t or "tp0" in t or "rank_0" in t] or traces)[0]
    torch.cuda.synchronize()
    prof.stop()
    path = f"{out}/prof_vllm.json"
    prof.export_chrome_trace(path)
    return path


def python_profile(engine, window, out: str) -> str:
    """cProfile over the window's engine steps (no torch profiler): where the host's time per
    step goes, by function; the top of the table is printed, all of it written to $OUT."""
    import cProfile
    import io
    import pstats

    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # a CPU dry run
    for _ in range(window[0]):
        engine.step()
    sync()
    prof, start = cProfile.Profile(), time.perf_counter()
    prof.enable()
    for _ in range(window[1] - window[0]):
        engine.step()
    sync()
    prof.disable()
    wall = time.perf_counter() - start
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(40)
    path = f"{out}/cprofile.txt"
    with open(path, "w") as f:
        # paths shortened to the package: the table is read side by side with another run's
        table = re.sub(r"/\S*/(site-packages|dist-packages)/|/\S*/(?=atom/)", "", text.getvalue())
        f.write(f"window wall {wall * 1e3:.1f} ms for {window[1] - window[0]} steps\n{table}")
    return path


def run(model: str, spec: str, window: tuple[int, int], out: str, batch_1: bool, python: bool = False):
    engine, tp, level = (spec + ":3").split(":")[:3]
    random.seed(0)
    prompts, max_tokens = ([list(range(1, 33))], [512]) if batch_1 else workload(256, 1024, 1024)
    params = [dict(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    if engine == "vllm" and python:
        return vllm_run(model, int(tp), prompts, params, window, out, python=True)
    if engine == "vllm":
        return summarise(vllm_run(model, int(tp), prompts, params, window, out))
    return summarise(atom_run(model, int(tp), int(level), prompts, params, window, out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--run", action="append", help="ENGINE:TP[:LEVEL], one engine each (default atom:1)")
    p.add_argument("--steps", default="300:340", help="the profiled window of engine steps, FIRST:LAST")
    p.add_argument("--batch-1", action="store_true", help="one request (batch-1 decode) instead of the workload")
    p.add_argument("--python", action="store_true", help="vLLM on one GPU: cProfile the host over the window instead")
    args = p.parse_args()
    out = os.environ.get("OUT", "gpu-results")
    window = tuple(int(x) for x in args.steps.split(":"))
    if args.python:
        for spec in args.run or ["vllm:1"]:
            path = run(args.model, spec, window, out, args.batch_1, python=True)
            print(open(path).read()[:7000])
        return
    results = {spec: run(args.model, spec, window, out, args.batch_1) for spec in args.run or ["atom:1"]}
    json.dump(results, open(f"{out}/profile_steps.json", "w"), indent=1)
    for tp, r in results.items():
        print(f"\n{tp}: top kernels (ms over the window)")
        for name, ms in r["top"]:
            print(f"  {ms:8.2f}  {name}")
        h = r["host"]
        print("  launches: " + ", ".join(f"{k} {n} ({ms:.1f} ms)" for k, (n, ms) in h["launches"].items()))
        print(f"  GPU idle gaps >= 50 us: {h['gaps']}, {h['gap_ms']:.1f} ms; host ops overlapping them (ms):")
        for name, ms in h["in_gaps"]:
            print(f"  {ms:8.2f}  {name}")
    kinds = sorted({k for r in results.values() for k in r["kinds"]})
    print("\n| run | window ms | GPU busy ms | " + " | ".join(kinds) + " |\n|" + "---|" * (len(kinds) + 3))
    for tp, r in results.items():
        cells = " | ".join(f"{r['kinds'].get(k, 0):.1f}" for k in kinds)
        print(f"| {tp} | {r['span_ms']:.1f} | {r['busy_ms']:.1f} | {cells} |")


if __name__ == "__main__":
    main()
