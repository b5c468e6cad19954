"""Batch-1 decode latency (time per output token) against the memory-bandwidth floor: the time to read
every weight once per token at the measured device-copy bandwidth (``weight bytes / copy bandwidth``;
with ``-tp N`` each GPU reads 1/N of the weights, so the floor is divided by N). FP8 models (a
checkpoint's ``quantization_config`` or ``--quantization fp8``) read one byte a weight in their layers.

    python -m atom.benchmarks.benchmark_latency --model qwen3-8b [--engine vllm] [--output-json r.json]
"""

from __future__ import annotations

import time

from atom.benchmarks.model_configs import Engine, copy_bandwidth, hf_config, parse_offline_args, report, weight_bytes


def tpot(args) -> float:
    """The best TPOT of ``args.repeats`` runs after a warm-up: atom's own measure; for vLLM the end-to-end
    time minus that of a 1-token run (the prefill), over the remaining tokens."""
    engine = Engine(args, max_num_seqs=8)
    prompt = [list(range(1000, 1000 + args.input_len))]
    params = engine.params(temperature=0, ignore_eos=True, max_tokens=args.output_len)
    engine.generate(prompt, params)  # warm-up
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        engine.generate(prompt, params)
        if not engine.vllm:
            best = min(best, engine.tpots[0])
            continue
        total, start = time.perf_counter() - start, time.perf_counter()
        engine.generate(prompt, engine.params(temperature=0, max_tokens=1))
        best = min(best, (total - (time.perf_counter() - start)) / (args.output_len - 1))
    return best


def main(argv=None) -> dict:
    rows = [("--input-len", 128, None), ("--output-len", 256, None), ("--repeats", 3, None)]
    args = parse_offline_args(__doc__, argv, "qwen3-8b", rows)
    fp8 = True if args.quantization == "fp8" else None  # quantised on load, or the checkpoint's own scheme
    t, bw, weights = tpot(args), copy_bandwidth(), weight_bytes(hf_config(args.model), fp8)
    floor = weights / bw / args.tensor_parallel_size
    result = dict(engine=args.engine, model=args.model, tp=args.tensor_parallel_size, tpot_ms=round(t * 1e3, 3))
    result |= dict(floor_ms=round(floor * 1e3, 3))
    result |= dict(fraction_of_floor=round(floor / t, 3), copy_bandwidth_gbs=round(bw / 1e9, 1))
    result["weight_gb"] = round(weights / 1e9, 3)
    columns = {"engine": args.engine, "model": args.model, "TPOT (ms)": f"{t * 1e3:.3f}"}
    columns |= {"floor (ms)": f"{floor * 1e3:.3f}", "floor/TPOT": f"{floor / t:.2f}", "copy GB/s": f"{bw / 1e9:.0f}"}
    return report(columns, result, args.output_json)


if __name__ == "__main__":
    main()
