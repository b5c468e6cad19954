"""Batch-1 decode latency (time per output token) against the memory-bandwidth floor.

The floor is the time to read every weight once per token at the measured device-copy
bandwidth: ``weight bytes / copy bandwidth``.

    python -m atom.benchmarks.benchmark_latency --model qwen3-8b [--engine vllm] [--output-json r.json]
"""

from __future__ import annotations

import time

import torch

from atom.benchmarks.model_configs import model_dir, parse_offline_args, report, weight_bytes


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

    llm = LLMEngine(
        path,
        load_dummy=True,
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        max_num_seqs=8,
    )
    prompt = list(range(1000, 1000 + args.input_len))
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    outs = [llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(args.repeats)]
    return min(o["tpot"] for o in outs)


def tpot_vllm(path: str, args) -> float:
    from vllm import LLM, SamplingParams

    llm = LLM(
        path,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        max_num_seqs=8,
    )
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
    args = parse_offline_args(__doc__, argv, "qwen3-8b", [
        (("--input-len",), dict(type=int, default=128)),
        (("--output-len",), dict(type=int, default=256)),
        (("--repeats",), dict(type=int, default=3)),
    ])  # fmt: skip
    path = model_dir(args.model)
    tpot = (tpot_vllm if args.engine == "vllm" else tpot_atom)(path, args)
    bw = copy_bandwidth()
    floor = weight_bytes(args.model) / bw
    result = dict(
        engine=args.engine,
        model=args.model,
        tpot_ms=round(tpot * 1e3, 3),
        floor_ms=round(floor * 1e3, 3),
        fraction_of_floor=round(floor / tpot, 3),
        copy_bandwidth_gbs=round(bw / 1e9, 1),
        weight_gb=round(weight_bytes(args.model) / 1e9, 3),
    )
    return report(
        "| engine | model | TPOT (ms) | floor (ms) | floor/TPOT | copy GB/s |\n|---|---|---|---|---|---|\n"
        f"| {args.engine} | {args.model} | {tpot * 1e3:.3f} | {floor * 1e3:.3f} | {floor / tpot:.2f} "
        f"| {bw / 1e9:.0f} |",
        result,
        args.output_json,
    )


if __name__ == "__main__":
    main()
