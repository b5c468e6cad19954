"""Offline throughput on nano-vllm's ``bench.py`` workload, for atom or vLLM.

``random.seed(0)`` before the engine starts; then 256 prompts of ``randint(0, 10000)``
token ids with lengths ``randint(100, 1024)`` and 256 ``max_tokens`` of
``randint(100, 1024)`` (133,966 output tokens), ``temperature=0.6``, ``ignore_eos``,
``max_model_len=4096``, random weights.

    python -m atom.benchmarks.benchmark_throughput --model qwen3-0.6b [--engine vllm] [--output-json r.json]
"""

from __future__ import annotations

import random
import time

from atom.benchmarks.model_configs import model_dir, parse_offline_args, report


def workload(num_seqs: int, max_input_len: int, max_output_len: int):
    # reseeded here too: vLLM's start-up draws from `random`, nano-vllm's and atom's do not,
    # so both engines get the same 133,966-token workload
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))] for _ in range(num_seqs)]
    max_tokens = [random.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def run_atom(path: str, args) -> float:
    from atom import LLMEngine, SamplingParams

    kwargs = dict(
        load_dummy=True, skip_tokenizer_init=True, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager
    )
    if args.level is not None:
        kwargs["level"] = args.level
    llm = LLMEngine(path, async_scheduling=args.async_scheduling, **kwargs)
    prompts, max_tokens = workload(args.num_seqs, args.max_input_len, args.max_output_len)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert sum(o["num_tokens_output"] for o in outs) == sum(max_tokens)
    return elapsed, sum(max_tokens)


def run_vllm(path: str, args) -> float:
    from vllm import LLM, SamplingParams

    extra = {"async_scheduling": True} if args.async_scheduling else {}  # else vLLM's own default
    llm = LLM(
        path,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        **extra,
    )
    prompts, max_tokens = workload(args.num_seqs, args.max_input_len, args.max_output_len)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, detokenize=False) for n in max_tokens]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8, detokenize=False), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(max_tokens)
    return elapsed, sum(max_tokens)


def main(argv=None) -> dict:
    args = parse_offline_args(__doc__, argv, "qwen3-0.6b", [
        (("--num-seqs",), dict(type=int, default=256)),
        (("--max-input-len",), dict(type=int, default=1024)),
        (("--max-output-len",), dict(type=int, default=1024)),
        (("--level",), dict(type=int, default=None)),
        (("--async-scheduling",), dict(action="store_true", help="both engines: overlap host work with the device")),
    ])  # fmt: skip
    random.seed(0)  # before the engine starts, as bench.py
    path = model_dir(args.model)
    elapsed, tokens = (run_vllm if args.engine == "vllm" else run_atom)(path, args)
    result = dict(
        engine=args.engine,
        model=args.model,
        num_seqs=args.num_seqs,
        output_tokens=tokens,
        elapsed_s=round(elapsed, 3),
        output_tokens_per_s=round(tokens / elapsed, 1),
        enforce_eager=args.enforce_eager,
        level=args.level,
        async_scheduling=args.async_scheduling,
    )
    return report(
        f"| engine | model | output tokens | time (s) | output tok/s |\n|---|---|---|---|---|\n"
        f"| {args.engine} | {args.model} | {tokens} | {elapsed:.2f} | {tokens / elapsed:.1f} |",
        result,
        args.output_json,
    )


if __name__ == "__main__":
    main()
