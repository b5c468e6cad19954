"""Quick check that a model loads and generates (serving guide section 3), or a chat.

    python -m atom.examples.simple_inference --model PATH [engine args] [--temperature 0.6]
    python -m atom.examples.simple_inference --interactive [--model PATH]   # chat on stdin

``--interactive`` reads one user message per line (until end of input, or ``/exit``), answers
each with the whole conversation so far as context (the model's chat template over the
history) and streams the reply; ``/reset`` starts a new conversation.
"""

from __future__ import annotations

import argparse
import logging
import sys

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
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True, enable_thinking=True
        )
        for p in PROMPTS
    ]


def chat_prompt(tokenizer, history: list[dict]) -> str:
    """The prompt that asks for the next assistant turn of ``history``."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    turns = [f"{m['role'].capitalize()}: {m['content']}" for m in history]
    return "\n".join(turns) + "\nAssistant:"


def fit_history(llm, history: list[dict], max_tokens: int) -> list[dict]:
    """``history`` without its oldest turns, as far as needed to leave room for the reply."""
    limit = llm.config.model_config.max_model_len - max_tokens
    while len(history) > 1 and len(llm.tokenizer.encode(chat_prompt(llm.tokenizer, history))) > limit:
        history = history[2:] if len(history) > 2 else history[1:]
    return history


def reply(llm, history: list[dict], params: SamplingParams) -> str:
    """Stream the assistant's answer to ``history`` to stdout; return its text."""
    [request_id] = llm.add_request(
        chat_prompt(llm.tokenizer, history),
        params,
        stream_callback=lambda out: print(out.delta_text, end="", flush=True),
    )
    while True:
        for out in llm.step():
            if out.request_id == request_id:
                print(flush=True)
                return out.text


def interactive(llm, params: SamplingParams, lines=sys.stdin) -> None:
    history: list[dict] = []
    prompt = "> " if lines.isatty() else ""
    print(
        f"Chat with the model (one message per line; /reset forgets, /exit or end of input quits)\n{prompt}",
        end="",
        flush=True,
    )
    for line in lines:
        message = line.strip()
        if message == "/exit":
            break
        if message == "/reset":
            history = []
        elif message:
            history = fit_history(llm, history + [{"role": "user", "content": message}], params.max_tokens)
            history.append({"role": "assistant", "content": reply(llm, history, params)})
        print(prompt, end="", flush=True)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--interactive", action="store_true", help="chat on stdin, keeping the conversation")
    args = parser.parse_args(argv)
    llm = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    if args.interactive:
        interactive(llm, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens))
        return
    prompts = build_prompts(llm.tokenizer)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(PROMPTS, outputs):
        print(
            f"\nPrompt: {prompt!r}\nCompletion: {out['text']!r}\n"
            f"  ({out['num_tokens_output']} tokens, ttft {out['ttft'] * 1000:.1f} ms, "
            f"tpot {out['tpot'] * 1000:.1f} ms, finish {out['finish_reason']})"
        )
    if llm.config.speculative_config.method is not None:
        llm.print_mtp_statistics()


if __name__ == "__main__":
    main()
