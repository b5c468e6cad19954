"""Every command in README.md and docs/*.md is checked against the code it names:

* each ``atom serve ...`` / ``python -m atom.X ...`` command in a shell block uses only flags
  that the module's real argparse parser defines (the parser is taken from the module's own
  ``main``, stopped at its first ``parse_args``), and a module that exists;
* a command that cannot run on this CPU machine says so where it stands: one naming a hub id
  (``org/name``) or a GPU-only setting (``--device cuda``, ``-tp``/``--tensor-parallel-size`` > 1)
  has "GPU" or "hub" in its block or in the paragraph just before it;
* every python block compiles, and its ``from atom... import`` names exist.

Placeholders in the docs (``[--api-key KEY]``, ``...``, ``{a,b}``, ``$VAR``) are read as such.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import pathlib
import re
import runpy
import shlex
import sys
from unittest import mock

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
COMMAND = re.compile(r"(?:^|\s)(atom serve\b|python3? -m atom[\w.]*)(.*)")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def blocks() -> list[tuple[str, str, str, str]]:
    """(doc, language, block text, the paragraph before it) of every fenced block."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            before = text[: m.start()].rstrip().split("\n\n")[-1]
            found.append((doc.name, m.group(1), m.group(2), before))
    return found


def commands() -> list[tuple[str, str, list[str], str]]:
    """(doc, module, argument tokens, context) of every atom command in a shell block."""
    found = []
    for doc, lang, body, before in blocks():
        if lang not in ("", "bash", "sh", "shell", "console"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            code = line.split(" #", 1)[0]
            for part in re.split(r"&&|;|\|\|?|(?<![>&])&(?!&)", code):
                m = COMMAND.search(part)
                if m is None:
                    continue
                head, rest = m.groups()
                module = "atom.entrypoints.openai_server" if head.startswith("atom serve") else head.split()[-1]
                found.append((doc, module, tokens(rest), f"{body}\n{before}"))
    return found


def tokens(rest: str) -> list[str]:
    rest = re.sub(r"\[[^\]]*\]", " ", rest)  # [optional arguments]
    rest = re.sub(r"\{([^,}]*),[^}]*\}", r"\1", rest)  # {one,of,these}: the first
    rest = re.split(r"\s[12]?>", rest)[0]  # output redirections
    return [t for t in shlex.split(rest.replace("...", " ")) if t]


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


COMMANDS = commands()


def test_the_docs_have_commands_to_check():
    assert len(COMMANDS) > 20 and {m for _, m, _, _ in COMMANDS} >= {"atom.entrypoints.openai_server"}


@pytest.mark.parametrize(
    ("doc", "module", "args", "context"), COMMANDS, ids=[f"{d}:{m}:{i}" for i, (d, m, _, _) in enumerate(COMMANDS)]
)
def test_command_flags_exist(doc, module, args, context):
    known = options(module)
    flags = [a.split("=", 1)[0] for a in args if a.startswith("-") and not re.fullmatch(r"-?\d[\d.]*", a)]
    unknown = [f for f in flags if f not in known]
    assert not unknown, f"{doc}: python -m {module} has no {', '.join(unknown)}"


@pytest.mark.parametrize(
    ("doc", "module", "args", "context"), COMMANDS, ids=[f"{d}:{m}:{i}" for i, (d, m, _, _) in enumerate(COMMANDS)]
)
def test_commands_that_need_a_gpu_or_the_hub_say_so(doc, module, args, context):
    models = [b for a, b in zip(args, args[1:]) if a == "--model"]
    if module == "atom.entrypoints.openai_server" and args and not args[0].startswith("-"):
        models.append(args[0])
    values = dict(zip(args, args[1:]))
    needs = [f"hub id {m}" for m in models if HUB_ID.match(m)]
    needs += ["--device cuda"] if values.get("--device") == "cuda" else []
    needs += [f"{f} {values[f]}" for f in ("-tp", "--tensor-parallel-size") if values.get(f, "1") not in ("1", "$tp")]
    if needs:
        assert re.search(r"\bGPU\b|\bhub\b", context), f"{doc}: {' '.join(args)} needs {needs}: say so beside it"


PYTHON_BLOCKS = [(doc, body) for doc, lang, body, _ in blocks() if lang in ("python", "py")]


@pytest.mark.parametrize(("doc", "body"), PYTHON_BLOCKS, ids=[d for d, _ in PYTHON_BLOCKS])
def test_python_snippets_compile_and_import_what_exists(doc, body):
    tree = ast.parse(body)  # a syntax error fails here
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "atom":
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), (
                    f"{doc}: {node.module} has no {alias.name}"
                )
