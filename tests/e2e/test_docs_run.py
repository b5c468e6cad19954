"""Every command of README.md and docs/*.md that runs on a CPU machine, run (doctest-like).

``tests/doc_commands.py`` extracts the commands; each one that is not marked GPU/hub (those have
their flags checked in ``tests/unit/test_docs_commands.py``) and not in its ``NOT_RUN_HERE``
table runs here, with the docs' sizes made small (``SIZES``, ``JSON_SIZES``) and their
placeholders filled (``PLACEHOLDERS``):

* server commands (``atom serve ARGS``, ``python -m atom.entrypoints.openai_server ARGS``: the
  same code, so each distinct ARGS starts once) start for real on 127.0.0.1 and a free port, with
  ``SERVER_FLAGS`` added; they must list the served name, complete, and with ``--reasoning-parser``
  answer ``reasoning_content``. ``atom serve`` (the default model) stays up for the commands that
  talk to a server: their ``127.0.0.1:8000`` / ``localhost:8000`` become its address;
* every other ``python -m atom.X`` runs, and ``CHECKS[X]`` reads its output;
* the curl lines of a block run in order with real ``curl``; every python block runs as a script.
"""

from __future__ import annotations

import glob
import json
import os
import re
import runpy
import subprocess
import sys
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import doc_commands as docs
import openai
import pytest
from server_process import ServerProcess, free_port

from atom.entrypoints.openai_server import DEFAULT_MODEL_NAME
from atom.model_loader.default_model import INSTALL_HINT, default_gguf_file, default_model_path

# the docs' sizes -> test sizes (a flag absent from a command is not added)
SIZES = {
    "--num-prompts": "2",
    "--random-input-len": "16",
    "--random-output-len": "4",
    "--random-prefix-len": "8",
    "--input-length": "16",
    "--output-length": "4",
    "--bs": "2",
    "--max-tokens": "4",
    "--limit": "1",
}
JSON_SIZES = {"max_tokens": 4}  # in curl request bodies
# flags added to every command that loads a model: a small KV cache (the default fills 2 GiB)
ENGINE_FLAGS = ("--kv-cache-memory-bytes", str(128 << 20))
# flags added to a module's commands: sizes the docs leave at their defaults
ADDED = {"atom.examples.simple_inference": ("--max-tokens", "4")}
DOCS_PORT = re.compile(r"(?:127\.0\.0\.1|localhost):8000")
# modules run inside the test process (HTTP clients: no model to load, and no interpreter start-up)
IN_PROCESS = {"atom.benchmarks.benchmark_serving", "atom.eval.accuracy"}
# python blocks that are sketches, not programs: compiled only (by the unit test)
SKETCHES = {("architecture.md", "my_op = register_op")}


@pytest.fixture(scope="module")
def placeholders(tiny_model) -> dict[str, str]:
    """The docs' placeholders -> what stands in for them here."""
    return {
        "/path/to/hf-model-dir": tiny_model,
        "/path/to/Qwen3-0.6B": tiny_model,  # a tiny Qwen3 checkpoint: the same architecture and template
        "PATH": tiny_model,
        "model.Q4_K_M.gguf": default_gguf_file(),
    }


@pytest.fixture(scope="module", autouse=True)
def default_model_installed():
    try:
        default_gguf_file()
    except FileNotFoundError:
        pytest.fail(f"the docs' commands run the default model: {INSTALL_HINT}")


def fill(args: tuple[str, ...], placeholders: dict[str, str]) -> list[str]:
    out = list(args)
    for i, arg in enumerate(out):
        out[i] = placeholders.get(arg, arg)
        if i and out[i - 1] in SIZES:
            out[i] = SIZES[out[i - 1]]
    return out


def without_address(args: list[str]) -> list[str]:
    """``args`` less ``--host X`` / ``--port X`` (the test picks the address)."""
    out, skip = [], False
    for arg in args:
        if not skip and arg not in ("--host", "--port"):
            out.append(arg)
        skip = arg in ("--host", "--port") and not skip
    return out


class DocServer(ServerProcess):
    """A server command from the docs, on 127.0.0.1 and a free port."""

    def __init__(self, args: list[str], workdir: Path):  # not super().__init__: it builds another command
        self.model, self.api_key = None, None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.profiler_dir = workdir / "traces"
        self.log_path = workdir / "server.log"
        cmd = [
            sys.executable,
            "-m",
            "atom.entrypoints.cli",
            "serve",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--torch-profiler-dir",
            str(self.profiler_dir),
            *ENGINE_FLAGS,
        ]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
        self._wait_ready()


def server_commands() -> dict[tuple[str, ...], list[str]]:
    """Distinct server argument lists (placeholders as written) -> where the docs give them."""
    found: dict[tuple[str, ...], list[str]] = {}
    for cmd in docs.commands():
        if docs.plan(cmd) == "run" and cmd.module == "atom.entrypoints.openai_server":
            found.setdefault(tuple(without_address(list(cmd.args))), []).append(f"{cmd.block.doc}: {cmd.text}")
    return found


SERVERS = server_commands()
OTHERS = [c for c in docs.commands() if docs.plan(c) == "run" and c.module != "atom.entrypoints.openai_server"]
CURL_BLOCKS = [b for b in docs.blocks() if not b.marked and any(blk == b for blk, _ in docs.curls())]
PYTHON = [b for b in docs.python_blocks() if not b.marked and (b.doc, b.body.split("(")[0].strip()) not in SKETCHES]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``atom serve`` with the default model, for every command that talks to a server."""
    srv = DocServer([], tmp_path_factory.mktemp("atom-serve"))
    yield srv
    srv.stop()


def check_server(srv: ServerProcess, args: list[str]) -> None:
    positional = [a for a in args[:1] if not a.startswith("-")]
    name = (positional or [DEFAULT_MODEL_NAME])[0]
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0, timeout=300)
    assert [m.id for m in client.models.list().data] == [name]
    out = client.completions.create(model=name, prompt="The capital of France is", max_tokens=2)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 2
    if "--reasoning-parser" in args:
        # a random tiny model never closes <think>: all of its output is reasoning
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert chat.choices[0].message.reasoning_content, chat


@pytest.mark.parametrize("args", list(SERVERS), ids=[" ".join(a) or "atom serve" for a in SERVERS])
def test_server_command(args, served, placeholders, tmp_path):
    if not args:
        check_server(served, [])
        return
    filled = fill(args, placeholders)
    srv = DocServer(filled, tmp_path)
    try:
        check_server(srv, filled)
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def at_server(args: list[str], srv: ServerProcess, module: str) -> list[str]:
    """The docs' server address -> ``srv``'s; a benchmark with no address gets ``--port``."""
    args = [DOCS_PORT.sub(f"127.0.0.1:{srv.port}", a) for a in args]
    if module == "atom.benchmarks.benchmark_serving" and not {"--base-url", "--port"} & set(args):
        args += ["--port", str(srv.port)]
    return args


def run_module(module: str, args: list[str], cwd: Path) -> tuple[int, str]:
    """``python -m module args`` in ``cwd``: exit status and stdout + stderr."""
    if module in IN_PROCESS:
        out, old = StringIO(), os.getcwd()
        argv, sys.argv = sys.argv, [module, *args]
        os.chdir(cwd)
        try:
            with redirect_stdout(out):
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        finally:
            sys.argv = argv
            os.chdir(old)
        return code, out.getvalue()
    argv = [sys.executable, "-m", module, *args, *ENGINE_FLAGS, *ADDED.get(module, ())]
    run = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
    return run.returncode, run.stdout + run.stderr


def value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def check_benchmark(args, output, cwd, srv):
    assert "Serving Benchmark Result" in output
    assert re.search(rf"Successful requests:\s+{value(args, '--num-prompts') or 1000}\b", output), output
    if "--save-result" in args:
        [path] = glob.glob(str(cwd / (value(args, "--result-dir") or ".") / (value(args, "--result-filename") or "*")))
        result = json.loads(Path(path).read_text())
        assert result["completed"] == int(value(args, "--num-prompts")) and result["mean_ttft_ms"] > 0
        for metric in value(args, "--percentile-metrics").split(","):
            assert f"p99_{metric}_ms" in result
    if "--profile" in args:
        assert glob.glob(str(srv.profiler_dir / "**" / "*.json*"), recursive=True), "no trace written"


def check_simple_inference(args, output, cwd, srv):
    assert output.count("Completion:") == 4, output


def check_profile_offline(args, output, cwd, srv):
    traces = cwd / value(args, "--torch-profiler-dir")
    assert glob.glob(str(traces / "**" / "*.json*"), recursive=True), output


def check_accuracy(args, output, cwd, srv):
    # the commands that run lm-eval are in NOT_RUN_HERE: --write-only writes the tasks, prints the commands
    assert "--write-only" in args
    assert (cwd / value(args, "--workdir") / "tasks" / "arc_easy.yaml").is_file(), output
    assert "lm_eval --model local-completions" in output and "lm_eval --model hf" in output


CHECKS = {
    "atom.benchmarks.benchmark_serving": check_benchmark,
    "atom.examples.simple_inference": check_simple_inference,
    "atom.examples.profile_offline": check_profile_offline,
    "atom.eval.accuracy": check_accuracy,
}


@pytest.mark.parametrize("cmd", OTHERS, ids=[f"{c.block.doc}: {c.text}"[:120] for c in OTHERS])
def test_command(cmd, served, placeholders, tmp_path):
    assert cmd.module in CHECKS, f"{cmd.block.doc}: add a check of {cmd.module}'s output to CHECKS"
    # the docs' scratch directories (/tmp/...) go under tmp_path; placeholders are filled after,
    # since the stand-in checkpoints live under /tmp themselves
    args = at_server(fill([a.removeprefix("/tmp/") for a in cmd.args], placeholders), served, cmd.module)
    code, output = run_module(cmd.module, args, tmp_path)
    assert code == 0, f"{cmd.text} exited with {code}:\n{output[-3000:]}"
    CHECKS[cmd.module](args, output, tmp_path, served)


def curl(argv: list[str], srv: ServerProcess) -> str:
    argv = [DOCS_PORT.sub(f"127.0.0.1:{srv.port}", a) for a in argv]
    if "-d" in argv:
        i = argv.index("-d") + 1
        argv[i] = json.dumps(json.loads(argv[i]) | {k: v for k, v in JSON_SIZES.items() if k in argv[i]})
    run = subprocess.run(["curl", "-sS", "--fail-with-body", *argv], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"curl {' '.join(argv)}: {run.returncode}\n{run.stdout}{run.stderr}"
    return run.stdout


@pytest.mark.parametrize("block", CURL_BLOCKS, ids=[b.doc for b in CURL_BLOCKS])
def test_curl_lines(block, served):
    traces = set(glob.glob(str(served.profiler_dir / "**" / "*.json*"), recursive=True))
    for b, argv in docs.curls():
        if b != block:
            continue
        body = curl(argv, served)
        if "/v1/" not in " ".join(argv):
            continue
        if "-N" in argv:  # a stream: server-sent events to [DONE]
            events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and all("choices" in json.loads(e) for e in events[:-1]), body
        else:
            assert json.loads(body)["choices"][0]["message"]["content"], body
    if "start_profile" in block.body:
        assert set(glob.glob(str(served.profiler_dir / "**" / "*.json*"), recursive=True)) > traces, "no new trace"


@pytest.mark.parametrize("block", PYTHON, ids=[f"{b.doc}: {b.body.splitlines()[0]}"[:80] for b in PYTHON])
def test_python_block(block, served, placeholders, tmp_path):
    code = DOCS_PORT.sub(f"127.0.0.1:{served.port}", block.body)
    # the README's LLMEngine(model=..., max_model_len=4096) needs a model that long: the default one's directory
    for placeholder, actual in (placeholders | {"/path/to/hf-model-dir": default_model_path()}).items():
        code = code.replace(f'"{placeholder}"', repr(actual))
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{block.doc}:\n{code}\n{run.stdout}{run.stderr[-3000:]}"
    assert run.stdout.strip() or "print(" not in code, f"{block.doc}: printed nothing\n{run.stderr[-3000:]}"
