"""xgrammar, imported when structured output is first used: ``import atom`` and plain generation work
on a machine where xgrammar is missing or its build is broken; only a structured-output request needs it."""

from __future__ import annotations

import importlib
from types import ModuleType


class StructuredOutputUnavailable(ValueError):
    """Structured output was requested but xgrammar cannot be imported (a ValueError: the request is
    refused with this message, and the engine keeps serving the others)."""


def xgrammar() -> ModuleType:
    try:
        return importlib.import_module("xgrammar")
    except Exception as error:  # ImportError, or whatever a broken build raises while importing
        raise StructuredOutputUnavailable(
            f"Structured output needs the xgrammar package, which cannot be imported here "
            f"({type(error).__name__}: {error}); install it with `pip install 'xgrammar>=0.2.8'`."
        ) from error
