"""Batch-1 decode latency (time per output token) against the memory-bandwidth floor.

The floor is the time to read every weight once per token at the measured device-copy
bandwidth: ``weight bytes / copy bandwidth``.

    python -m atom.benchmarks.benchmark_latency --model qwen3-8b [--engine vllm] [--output-json r.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from atom.benchmarks.model_configs import CONFIGS, model_dir, weight_bytes

logger = logging.getLogger(__name__)


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * nbytes * iters / (time.perf_counter() - start)


def tpot_atom(path: str, args) -> float:
    from atom import LLMEngine, SamplingParams

    llm = LLMEngine(path, load_dummy=True, skip_tokenizer_init=True, max_model_len=args.max_model_len,
                    enforce_eager=args.enforce_eager, max_num_seqs=8)
    prompt = list(range(1000, 1000 + args.input_len))
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    outs = [llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(args.repeats)]
    return min(o["tpot"] for o in outs)


def tpot_vllm(path: str, args) -> float:
    from vllm import LLM, SamplingParams

    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, max_model_len=args.max_model_len,
              enforce_eager=args.enforce_eager, max_num_seqs=8)
    prompt = {"prompt_token_ids": list(range(1000, 1000 + args.input_len))}
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len, detokenize=False)
    llm.generate([prompt], params, use_tqdm=False)
    best = float("inf")
    for _ in range(args.repeats):
        # TPOT from end-to-end time minus a 1-token run (the prefill), over the remaining tokens
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        total = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, detokenize=False), use_tqdm=False)
        first = time.perf_counter() - t0
        best = min(best, (total - first) / (args.output_len - 1))
    return best


def main(argv=None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b", help=f"one of {', '.join(CONFIGS)}")
    p.add_argument("--engine", choices=["atom", "vllm"], default="atom")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    path = model_dir(args.model)
    tpot = (tpot_vllm if args.engine == "vllm" else tpot_atom)(path, args)
    bw = copy_bandwidth()
    floor = weight_bytes(args.model) / bw
    result = dict(engine=args.engine, model=args.model, tpot_ms=round(tpot * 1e3, 3),
                  floor_ms=round(floor * 1e3, 3), fraction_of_floor=round(floor / tpot, 3),
                  copy_bandwidth_gbs=round(bw / 1e9, 1), weight_gb=round(weight_bytes(args.model) / 1e9, 3))
    print("| engine | model | TPOT (ms) | floor (ms) | floor/TPOT | copy GB/s |\n|---|---|---|---|---|---|\n"
          f"| {args.engine} | {args.model} | {tpot * 1e3:.3f} | {floor * 1e3:.3f} | {floor / tpot:.2f} "
          f"| {bw / 1e9:.0f} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
