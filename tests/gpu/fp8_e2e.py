"""FP8 end to end on a real model: teacher-forced top-1 agreement (on positions where the
reference's top-1 leads by more than 0.5 in logprob) of
  1. ``--kv_cache_dtype fp8`` vs the bf16 KV cache (issue target: >= 99%),
  2. ``--quantization fp8`` (per-channel weights, per-token activations) vs bf16 weights,
  3. optionally an FP8 checkpoint (``--fp8-model``) vs the bf16 model.
Each engine is freed before the next starts. Writes $OUT/fp8_e2e.json (or ./gpu-results).

    python tests/gpu/fp8_e2e.py --model /path/to/Qwen3-8B [--fp8-model /path/to/Qwen3-8B-FP8]
    python tests/gpu/fp8_e2e.py --model /path/to/DeepSeek-V2-Lite --kv-only   # MLA's latent cache
    python tests/gpu/fp8_e2e.py --model /path/to/DeepSeek-R1 --kv-only -tp 8   # R1's FP8 weights
    python -m atom.testing.fp8_checkpoint /path/to/DeepSeek-V2-Lite /tmp/V2-Lite-FP8 --format block
    python tests/gpu/fp8_e2e.py --model /path/to/DeepSeek-V2-Lite --fp8-model /tmp/V2-Lite-FP8
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch

from atom import LLMEngine
from atom.testing.agreement import greedy_ids, top2

PROMPTS = [
    "Explain how paged attention stores the KV cache.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "The capital of France is",
    "List three differences between TCP and UDP.",
    "Once upon a time, in a small village by the sea,",
    "Translate to German: The weather is nice today.",
    "What is 17 times 23? Think step by step.",
    "Summarise the plot of Hamlet in two sentences.",
]


def scores(model: str, sequences, tp: int, **kwargs):
    engine = LLMEngine(model, max_model_len=2048, gpu_memory_utilization=0.85, tensor_parallel_size=tp, **kwargs)
    result = top2(engine, sequences)
    engine.shutdown()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return result


def agreement(ref, cand, margin: float = 0.5) -> dict:
    pairs = [(r, c) for rs, cs in zip(ref, cand) for r, c in zip(rs, cs) if r[1] > margin]
    return dict(agreement=sum(r[0] == c[0] for r, c in pairs) / max(1, len(pairs)), positions=len(pairs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--fp8-model", default=None)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--kv-only", action="store_true", help="only the fp8 KV cache comparison")
    args = parser.parse_args()
    tp = args.tensor_parallel_size
    engine = LLMEngine(args.model, max_model_len=2048, gpu_memory_utilization=0.85, tensor_parallel_size=tp)
    sequences = greedy_ids(engine, PROMPTS, args.max_tokens)
    ref = top2(engine, sequences)
    engine.shutdown()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    results = {"fp8_kv_vs_bf16_kv": agreement(ref, scores(args.model, sequences, tp, kv_cache_dtype="fp8"))}
    if not args.kv_only:
        results["quantization_fp8_vs_bf16"] = agreement(ref, scores(args.model, sequences, tp, quantization="fp8"))
    if args.fp8_model:
        results["fp8_checkpoint_vs_bf16"] = agreement(ref, scores(args.fp8_model, sequences, tp))
    out = os.environ.get("OUT") or "gpu-results"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "fp8_e2e.json"), "w") as f:
        json.dump(results, f, indent=1)
    for name, r in results.items():
        print(f"{name}: {r['agreement']:.4f} over {r['positions']} clear positions")


if __name__ == "__main__":
    main()
