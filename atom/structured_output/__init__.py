"""Structured output with xgrammar: grammars compiled off the engine loop, a per-request
matcher, and a batched token bitmask applied to the logits before sampling. xgrammar itself is
imported on first use (``xgrammar_import``), so ``import atom`` does not need it."""

from atom.structured_output import bitmask
from atom.structured_output.compiler import GrammarCompiler
from atom.structured_output.manager import StructuredOutputManager
from atom.structured_output.matcher import GrammarState
from atom.structured_output.spec import GrammarSpec
from atom.structured_output.xgrammar_import import StructuredOutputUnavailable

__all__ = [
    "GrammarCompiler",
    "GrammarSpec",
    "GrammarState",
    "StructuredOutputManager",
    "StructuredOutputUnavailable",
    "bitmask",
]
