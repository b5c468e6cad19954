"""Offline throughput on nano-vllm's ``bench.py`` workload, for atom or vLLM: ``random.seed(0)`` before the
engine starts; 256 prompts of ``randint(0, 10000)`` token ids with lengths ``randint(100, 1024)`` and 256
``max_tokens`` of ``randint(100, 1024)`` (133,966 output tokens), ``temperature=0.6``, ``ignore_eos``,
``max_model_len=4096``, random weights.

    python -m atom.benchmarks.benchmark_throughput --model qwen3-0.6b [--engine vllm] [--output-json r.json]
"""

from __future__ import annotations

import argparse
import random
import time

from atom.benchmarks.model_configs import Engine, parse_offline_args, report


def workload(num_seqs: int, max_input_len: int, max_output_len: int):
    # reseeded here too: vLLM's start-up draws from `random`, nano-vllm's and atom's do not,
    # so both engines get the same 133,966-token workload
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))] for _ in range(num_seqs)]
    max_tokens = [random.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def run(args) -> tuple[float, int]:
    """Seconds to generate the workload, and its output tokens."""
    # unset: each engine's own default (atom: async on; vLLM: its own)
    kwargs = {} if args.async_scheduling is None else {"async_scheduling": args.async_scheduling}
    if args.level is not None and args.engine == "atom":
        kwargs["level"] = args.level
    engine = Engine(args, **kwargs)
    prompts, max_tokens = workload(args.num_seqs, args.max_input_len, args.max_output_len)
    params = [engine.params(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    engine.generate([[1, 2, 3]], engine.params(max_tokens=8))  # warm-up
    start = time.perf_counter()
    output_tokens = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert sum(output_tokens) == sum(max_tokens)
    return elapsed, sum(max_tokens)


def main(argv=None) -> dict:
    rows = [("--num-seqs", 256, None), ("--max-input-len", 1024, None), ("--max-output-len", 1024, None)]
    rows.append(("--level", int, "atom's compilation level"))
    sync = dict(action=argparse.BooleanOptionalAction, default=None)
    rows.append(("--async-scheduling", False, "overlap host and device work (default: each engine's own)", sync))
    args = parse_offline_args(__doc__, argv, "qwen3-0.6b", rows)
    random.seed(0)  # before the engine starts, as bench.py
    elapsed, tokens = run(args)
    result = dict(engine=args.engine, model=args.model, tp=args.tensor_parallel_size)
    result |= dict(expert_parallel=args.enable_expert_parallel, num_seqs=args.num_seqs, output_tokens=tokens)
    result |= dict(elapsed_s=round(elapsed, 3), output_tokens_per_s=round(tokens / elapsed, 1))
    result |= dict(enforce_eager=args.enforce_eager, level=args.level, async_scheduling=args.async_scheduling)
    columns = {"engine": args.engine, "model": args.model, "output tokens": tokens, "time (s)": f"{elapsed:.2f}"}
    return report(columns | {"output tok/s": f"{tokens / elapsed:.1f}"}, result, args.output_json)


if __name__ == "__main__":
    main()
