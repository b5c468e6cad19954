"""Host launch against GPU time of prefill steps (docs/performance.md, session 12): one engine
(Qwen3-8B's shape, random weights, or ``PH_MODEL``), requests of 1024 prompt tokens one at a time
(serving at concurrency 1), two bursts of 16, then single prompts of 32-4096 tokens. Prints each
prefill step's host launch, GPU time and the GPU's idle gap before it (``ATOM_STEP_TRACE``) and
the caching allocator's counters; writes a torch-profiler trace of one 1024-token prefill under
$OUT (``python tests/gpu/host_ops.py TRACE`` sums its host side) and the rows as JSON.

    OUT=/tmp/p python tests/gpu/prefill_steps.py [LEVEL] [CUDAGRAPH_MODE]
"""

import json
import logging
import os
import random
import sys
import time

import torch

from atom import LLMEngine, SamplingParams
from atom.benchmarks.model_configs import model_dir

ALLOCATOR = ["num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms"]


def allocator() -> dict:
    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    return {k: stats.get(k, 0) for k in ALLOCATOR}


def run(llm, prompts, max_tokens=8, profile=False) -> float:
    """Milliseconds until every prompt finished; the first step under the profiler if asked."""
    ids = set(llm.add_request(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.6)))
    start, done, steps = time.perf_counter(), 0, 0
    while done < len(ids):
        if profile and steps == 0:
            llm.start_profile()
        done += sum(o.request_id in ids for o in llm.step())
        if profile and steps == 0:
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            llm.stop_profile()
        steps += 1
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    level = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    mode = sys.argv[2] if len(sys.argv) > 2 else "FULL_AND_PIECEWISE"
    out = os.environ["OUT"]
    trace = f"{out}/steps_l{level}_{mode}.jsonl"
    os.environ["ATOM_STEP_TRACE"] = trace
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("atom").setLevel(logging.INFO)
    start = time.time()
    llm = LLMEngine(model_dir(os.environ.get("PH_MODEL", "qwen3-8b")), load_dummy=True, skip_tokenizer_init=True,
                    max_model_len=4096, level=level, cudagraph_mode=mode,
                    torch_profiler_dir=f"{out}/prof_l{level}_{mode}")  # fmt: skip
    print(f"start-up {time.time() - start:.1f} s", flush=True)
    random.seed(0)

    def prompt(n):
        return [random.randrange(100, 30000) for _ in range(n)]

    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    for i in range(4):
        print(f"c=1 request {i}: {run(llm, [prompt(1024)]):.1f} ms", allocator(), flush=True)
    print(f"profiled request: {run(llm, [prompt(1024)], profile=True):.1f} ms", flush=True)
    for i in range(2):
        print(f"c=16 burst {i}: {run(llm, [prompt(1024) for _ in range(16)]):.1f} ms", allocator(), flush=True)
    for n in (32, 256, 2048, 4096):
        print(f"one prompt of {n}: {run(llm, [prompt(n)], max_tokens=2):.1f} ms", flush=True)
    llm.shutdown()
    rows = [json.loads(line) for line in open(trace) if '"launch_ms"' in line]
    prefills = [r for r in rows if r["prefill_tokens"]]
    print("| prefill tokens | decodes | launch ms | GPU ms | gap before ms |\n|---|---|---|---|---|")
    for r in prefills:
        print(f"| {r['prefill_tokens']} | {r['decodes']} | {r['launch_ms']:.2f} | {r.get('gpu_ms', -1):.2f} | "
              f"{r.get('gap_ms', -1):.2f} |")
    decodes = sorted(r["launch_ms"] for r in rows if not r["prefill_tokens"])
    print(f"decode steps: {len(decodes)}, launch ms median {decodes[len(decodes) // 2]:.2f}")
    with open(f"{out}/prefill_steps_l{level}_{mode}.json", "w") as f:
        json.dump(dict(level=level, mode=mode, prefills=prefills, decode_launch_ms=decodes), f)


if __name__ == "__main__":
    main()
