"""The commands and code blocks of README.md and docs/*.md, as the docs tests read them.

``tests/unit/test_docs_commands.py`` checks every atom command's flags and that a command that
cannot run on a CPU machine says so; ``tests/e2e/test_docs_run.py`` runs all the others, except
the few in ``NOT_RUN_HERE``.

A command is *marked* (not run, flags checked only) when "GPU" or "hub" stands in its block or
in the paragraph just before it, or when its doc is a GPU log (``GPU_DOCS``).
"""

from __future__ import annotations

import pathlib
import re
import shlex
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
COMMAND = re.compile(r"(?:^|\s)(atom serve\b|python3? -m atom[\w.]*)(.*)")
CURL = re.compile(r"(?:^|\s)curl\s(.*)")
SHELL = ("", "bash", "sh", "shell", "console")
MARK = re.compile(r"\bGPU\b|\bhub\b")
# docs whose every command is a record of a GPU run (the performance log)
GPU_DOCS = {"performance.md"}


@dataclass(frozen=True, slots=True)
class Block:
    doc: str
    lang: str
    body: str
    before: str  # the paragraph just before the block

    @property
    def context(self) -> str:
        return f"{self.body}\n{self.before}"

    @property
    def marked(self) -> bool:
        return self.doc in GPU_DOCS or bool(MARK.search(self.context))


@dataclass(frozen=True, slots=True)
class Command:
    block: Block
    module: str  # what runs: atom serve is atom.entrypoints.openai_server's command line
    serve: bool  # written as ``atom serve`` (the console script)
    args: tuple[str, ...]

    @property
    def text(self) -> str:
        head = "atom serve" if self.serve else f"python -m {self.module}"
        return " ".join([head, *self.args])


def blocks() -> list[Block]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            before = text[: m.start()].rstrip().split("\n\n")[-1]
            found.append(Block(doc.name, m.group(1), m.group(2), before))
    return found


def shell_parts(block: Block) -> list[str]:
    """Every simple command of a shell block: continuations joined, comments and operators split."""
    parts = []
    for line in block.body.replace("\\\n", " ").splitlines():
        code = line.split(" #", 1)[0]
        if not code.lstrip().startswith("#"):
            parts += [p.strip() for p in re.split(r"&&|;|\|\|?|(?<![>&])&(?!&)", code) if p.strip()]
    return parts


def commands() -> list[Command]:
    """Every ``atom serve ...`` / ``python -m atom.X ...`` of a shell block."""
    found = []
    for block in blocks():
        if block.lang not in SHELL:
            continue
        for part in shell_parts(block):
            m = COMMAND.search(part)
            if m is not None:
                head, rest = m.groups()
                serve = head.startswith("atom serve")
                module = "atom.entrypoints.openai_server" if serve else head.split()[-1]
                found.append(Command(block, module, serve, tuple(tokens(rest))))
    return found


def curls() -> list[tuple[Block, list[str]]]:
    """Every ``curl ...`` of a shell block, as its argument list."""
    return [
        (block, shlex.split(m.group(1)))
        for block in blocks()
        if block.lang in SHELL
        for part in shell_parts(block)
        if (m := CURL.search(part))
    ]


def tokens(rest: str) -> list[str]:
    """A command's arguments; the docs' placeholders read as such."""
    rest = re.sub(r"\[[^\]]*\]", " ", rest)  # [optional arguments]
    rest = re.sub(r"\{([^,}]*),[^}]*\}", r"\1", rest)  # {one,of,these}: the first
    rest = re.split(r"\s[12]?>", rest)[0]  # output redirections
    return [t for t in shlex.split(rest.replace("...", " ")) if t]


def python_blocks() -> list[Block]:
    return [b for b in blocks() if b.lang in ("python", "py")]


# Commands not run by tests/e2e/test_docs_run.py, and why: lm-eval takes minutes on a CPU (its
# GSM8K task generates up to 256 tokens a document), so the named test runs the same path on a few
# ARC-Easy documents; ``--write-only`` (no lm-eval run) is run.
LM_EVAL_TEST = "tests/e2e/test_lm_eval.py::test_arc_easy_through_the_server_matches_hf"
NOT_RUN_HERE = {
    "python -m atom.eval.accuracy --tasks all --backends completions,hf": LM_EVAL_TEST,
    "python -m atom.eval.accuracy --tasks arc_easy --limit 30 --backends completions,hf": LM_EVAL_TEST,
    "python -m atom.eval.accuracy --tasks gsm8k --backends completions,chat,hf": LM_EVAL_TEST,
    "python -m atom.eval.accuracy --base-url http://127.0.0.1:8000 --tasks all": LM_EVAL_TEST,
    "python -m atom.eval.accuracy --base-url http://127.0.0.1:8000 --tasks all --backends completions,chat "
    "--workdir /tmp/acc-vllm-atom": LM_EVAL_TEST,
}


def plan(command: Command) -> str:
    """One of "marked" (GPU/hub: flags checked only), "not run" (NOT_RUN_HERE) or "run"."""
    if command.block.marked:
        return "marked"
    return "not run" if command.text in NOT_RUN_HERE else "run"
