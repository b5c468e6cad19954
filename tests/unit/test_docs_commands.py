"""Every command in README.md and docs/*.md is checked against the code it names:

* each ``atom serve ...`` / ``python -m atom.X ...`` command in a shell block uses only flags
  that the module's real argparse parser defines (the parser is taken from the module's own
  ``main``, stopped at its first ``parse_args``), and a module that exists;
* a command that cannot run on this CPU machine says so where it stands: one naming a hub id
  (``org/name``) or a GPU-only setting (``--device cuda``, ``-tp``/``--tensor-parallel-size`` > 1)
  has "GPU" or "hub" in its block or in the paragraph just before it;
* every other command runs in ``tests/e2e/test_docs_run.py``, or is in ``NOT_RUN_HERE`` with the
  reason (``tests/doc_commands.py``, which extracts the commands for both files);
* every python block compiles, and its ``from atom... import`` names exist.

Placeholders in the docs (``[--api-key KEY]``, ``...``, ``{a,b}``, ``$VAR``) are read as such.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import runpy
import sys
from unittest import mock

import doc_commands as docs
import pytest

COMMANDS = docs.commands()
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def real_parser(module: str) -> argparse.ArgumentParser:
    """The parser the module's ``main`` builds, taken at its first parse."""

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture),
        mock.patch.object(sys, "argv", [module]),
    ):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=False)
        except _Captured as got:
            return got.parser
    raise AssertionError(f"{module} never parsed its arguments")


_PARSERS: dict[str, argparse.ArgumentParser] = {}


def options(module: str) -> set[str]:
    if module not in _PARSERS:
        _PARSERS[module] = real_parser(module)
    return set(_PARSERS[module]._option_string_actions)


IDS = [f"{c.block.doc}:{c.module}:{i}" for i, c in enumerate(COMMANDS)]


def test_the_docs_have_commands_to_check():
    assert len(COMMANDS) > 20 and {c.module for c in COMMANDS} >= {"atom.entrypoints.openai_server"}


@pytest.mark.parametrize("cmd", COMMANDS, ids=IDS)
def test_command_flags_exist(cmd):
    known = options(cmd.module)
    flags = [a.split("=", 1)[0] for a in cmd.args if a.startswith("-") and not re.fullmatch(r"-?\d[\d.]*", a)]
    unknown = [f for f in flags if f not in known]
    assert not unknown, f"{cmd.block.doc}: python -m {cmd.module} has no {', '.join(unknown)}"


@pytest.mark.parametrize("cmd", COMMANDS, ids=IDS)
def test_commands_that_need_a_gpu_or_the_hub_say_so(cmd):
    module, args = cmd.module, cmd.args
    models = [b for a, b in zip(args, args[1:]) if a == "--model"]
    if module == "atom.entrypoints.openai_server" and args and not args[0].startswith("-"):
        models.append(args[0])
    values = dict(zip(args, args[1:]))
    needs = [f"hub id {m}" for m in models if HUB_ID.match(m)]
    needs += ["--device cuda"] if values.get("--device") == "cuda" else []
    needs += [f"{f} {values[f]}" for f in ("-tp", "--tensor-parallel-size") if values.get(f, "1") not in ("1", "$tp")]
    if needs:
        assert cmd.block.marked, f"{cmd.block.doc}: {cmd.text} needs {needs}: say GPU or hub beside it"


def test_every_command_is_run_or_marked():
    """A command not marked GPU/hub runs in tests/e2e/test_docs_run.py, or is in NOT_RUN_HERE with
    the reason (a test named there exists); an entry there that the docs no longer have is stale."""
    plans = {c.text: docs.plan(c) for c in COMMANDS}
    assert {"run", "marked", "not run"} == set(plans.values())
    stale = set(docs.NOT_RUN_HERE) - {t for t, p in plans.items() if p == "not run"}
    assert not stale, f"NOT_RUN_HERE names commands the docs no longer have: {stale}"
    for why in docs.NOT_RUN_HERE.values():
        if "::" in why:
            path, name = why.split("::")
            assert f"def {name}(" in (docs.ROOT / path).read_text(), why


PYTHON_BLOCKS = docs.python_blocks()


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.doc for b in PYTHON_BLOCKS])
def test_python_snippets_compile_and_import_what_exists(block):
    doc = block.doc
    tree = ast.parse(block.body)  # a syntax error fails here
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "atom":
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), (
                    f"{doc}: {node.module} has no {alias.name}"
                )
