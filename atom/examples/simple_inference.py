"""Quick check that a model loads and generates (serving guide section 3).

    python -m atom.examples.simple_inference --model PATH [engine args] [--temperature 0.6]
"""

from __future__ import annotations

import argparse
import logging

from atom import LLMEngine, SamplingParams
from atom.engine.arg_utils import EngineArgs

PROMPTS = [
    "introduce yourself",
    "list all prime numbers within 100",
    "1+2+3=?",
    "如何在一个月内增肌10公斤",
]


def build_prompts(tokenizer) -> list[str]:
    if not getattr(tokenizer, "chat_template", None):
        return PROMPTS
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                      add_generation_prompt=True, enable_thinking=True)
        for p in PROMPTS
    ]


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    llm = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    prompts = build_prompts(llm.tokenizer)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(PROMPTS, outputs):
        print(f"\nPrompt: {prompt!r}\nCompletion: {out['text']!r}\n"
              f"  ({out['num_tokens_output']} tokens, ttft {out['ttft'] * 1000:.1f} ms, "
              f"tpot {out['tpot'] * 1000:.1f} ms, finish {out['finish_reason']})")


if __name__ == "__main__":
    main()
