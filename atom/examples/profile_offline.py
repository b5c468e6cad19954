"""Profile one offline batch with the torch profiler (serving guide section 5.4).

    python -m atom.examples.profile_offline --model PATH [engine args] \\
        [--torch-profiler-dir ./profiler_traces] [--input-length 128] [--output-length 32] \\
        [--bs 1] [--random-input]

A warm-up batch runs first (so that compilation and first-call costs stay out of the
trace), then the profiled batch; traces land in ``<dir>/rank_0/`` as gzip-compressed
TensorBoard files (``tensorboard --logdir <dir>`` or chrome://tracing).
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import random
import time

from atom import LLMEngine, SamplingParams
from atom.engine.arg_utils import EngineArgs

logger = logging.getLogger("atom.examples.profile_offline")

DEFAULT_PROFILER_DIR = "./profiler_traces"
TEXT = ("The history of computing is a story of abstractions stacked upon abstractions: transistors become "
        "logic gates, gates become processors, processors run operating systems, and operating systems host the "
        "programs that people actually use. Each layer hides the details of the one below it. ")


def make_prompts(tokenizer, vocab_size: int, input_length: int, bs: int, random_input: bool) -> list[list[int]]:
    """``bs`` token-id prompts of ``input_length`` tokens: predefined text, or random ids."""
    if random_input or tokenizer is None:
        rng = random.Random(0)
        return [[rng.randrange(vocab_size) for _ in range(input_length)] for _ in range(bs)]
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    ids = (ids * (input_length // len(ids) + 1))[:input_length]
    # each prompt starts differently, so that a prefix cache cannot share them
    return [[(ids[0] + i) % vocab_size] + ids[1:] for i in range(bs)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(description=__doc__,
                                                             formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--input-length", type=int, default=128, help="approximate prompt length in tokens")
    parser.add_argument("--output-length", type=int, default=32, help="tokens to generate per request")
    parser.add_argument("--bs", type=int, default=1, help="batch size (parallel requests)")
    parser.add_argument("--random-input", action="store_true", help="random token ids instead of predefined text")
    args = parser.parse_args(argv)
    if min(args.input_length, args.output_length, args.bs) < 1:
        parser.error("--input-length, --output-length and --bs must be >= 1")
    args.torch_profiler_dir = (args.torch_profiler_dir or os.environ.get("ATOM_TORCH_PROFILER_DIR")
                               or DEFAULT_PROFILER_DIR)
    return args


def main(argv: list[str] | None = None) -> list[str]:
    """Run the profile; returns the trace files written."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    llm = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    vocab = llm.config.model_config.hf_config.vocab_size
    prompts = make_prompts(llm.tokenizer, vocab, args.input_length, args.bs, args.random_input)
    params = SamplingParams(temperature=0, max_tokens=args.output_length, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    trace_dir = os.path.join(args.torch_profiler_dir, "rank_0")
    before = set(glob.glob(os.path.join(trace_dir, "*")))
    llm.start_profile()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.stop_profile()
    traces = sorted(set(glob.glob(os.path.join(trace_dir, "*"))) - before)
    tokens = sum(o["num_tokens_output"] for o in outputs)
    logger.info("profiled %d requests x %d input tokens -> %d output tokens in %.3f s (%.1f tok/s)",
                args.bs, args.input_length, tokens, elapsed, tokens / elapsed)
    for path in traces:
        logger.info("trace: %s", path)
    return traces


if __name__ == "__main__":
    main()
