"""``atom serve`` as a vLLM user types it, end to end: the model as an argument, ``--port`` as
the HTTP port, the served name as given, one-line start-up errors, ``/tokenize`` and
``/detokenize``."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import requests
import tomllib
from server_process import MAX_MODEL_LEN, ServerProcess, assert_serving, free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cli_server(tiny_model, tmp_path_factory):
    srv = ServerProcess(tiny_model, tmp_path_factory.mktemp("cli"), via_cli=True)
    yield srv
    srv.stop()


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "atom.entrypoints.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_console_script_is_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["atom"] == "atom.entrypoints.cli:main"
    out = run_cli("serve", "--help")
    assert out.returncode == 0 and "--port" in out.stdout and "--engine-port" in out.stdout
    assert "HTTP port" in out.stdout


def test_atom_serve_model_on_port(cli_server, tiny_model):
    """``atom serve MODEL --port P`` serves on P, under the name MODEL as given."""
    client = openai.OpenAI(base_url=f"{cli_server.url}/v1", api_key="EMPTY", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [tiny_model]
    out = client.chat.completions.create(model=tiny_model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert out.model == tiny_model and out.choices[0].finish_reason == "length"


def test_taken_port_fails_in_one_line_before_the_model_loads(tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_cli("serve", tiny_model, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu")
    assert out.returncode == 1
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert f"cannot listen on 127.0.0.1:{port}" in lines[0] and "--port" in lines[0]


def test_startup_errors_are_one_line_unless_debugging(tmp_path):
    missing = str(tmp_path / "no-such-model")
    args = ("serve", missing, "--host", "127.0.0.1", "--port", str(free_port()), "--device", "cpu")
    out = run_cli(*args)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode == 1 and len(lines) == 1, lines
    assert "no-such-model" in lines[0] and "Traceback" not in lines[0]
    out = run_cli(*args, "--log-level", "debug")
    assert out.returncode == 1 and "Traceback" in out.stderr


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


@pytest.mark.parametrize("as_file", [True, False])
def test_chat_template_flag(tiny_model, tmp_path, as_file):
    # vLLM's --chat-template: a file or the template itself, for every chat request and /tokenize
    from transformers import AutoTokenizer

    arg = TEMPLATE
    if as_file:
        arg = str(tmp_path / "template.jinja")
        Path(arg).write_text(TEMPLATE)
    srv = ServerProcess(tiny_model, tmp_path, via_cli=True, extra_args=("--chat-template", arg))
    try:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        r = srv.post("/tokenize", {"messages": messages})
        expected = "[system] Be brief.\n[user] Hi\n[assistant]"
        assert r.status_code == 200 and r.json()["tokens"] == AutoTokenizer.from_pretrained(tiny_model).encode(
            expected, add_special_tokens=False)
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0, timeout=60)
        out = client.chat.completions.create(model=tiny_model, messages=messages, max_tokens=2)
        assert out.usage.prompt_tokens == len(r.json()["tokens"])
    finally:
        srv.stop()


def test_unreadable_chat_template_is_a_one_line_startup_error(tiny_model, tmp_path):
    out = run_cli("serve", tiny_model, "--port", str(free_port()), "--device", "cpu",
                  "--chat-template", str(tmp_path / "missing.jinja"))  # fmt: skip
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode == 1 and len(lines) == 1, lines
    assert "--chat-template" in lines[0] and "cannot be read" in lines[0]


def test_two_different_models_are_refused(tiny_model):
    out = run_cli("serve", tiny_model, "--model", "/elsewhere", "--port", str(free_port()))
    assert out.returncode == 2 and "two models given" in out.stderr


# /tokenize and /detokenize


def test_tokenize_and_detokenize(cli_server, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = "The quick brown fox jumps over the lazy dog."
    r = cli_server.post("/tokenize", {"model": tiny_model, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert "".join(body["token_strs"]) == text
    r = cli_server.post("/detokenize", {"model": tiny_model, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": text}

    messages = [{"role": "user", "content": "Hi"}]
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    r = cli_server.post("/tokenize", {"messages": messages})
    assert r.json()["tokens"] == tok.encode(expected, add_special_tokens=False)

    # a text longer than the context is counted, not refused
    r = cli_server.post("/tokenize", {"prompt": text * 100})
    assert r.status_code == 200 and r.json()["count"] > MAX_MODEL_LEN
    # and the empty text is its special tokens (vLLM's answer), not an error
    r = cli_server.post("/tokenize", {"prompt": ""})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tok("")["input_ids"] and r.json()["count"] == len(tok("")["input_ids"])


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/tokenize", {"prompt": "a\ud800"}, 400, "prompt"),
        ("/tokenize", {"prompt": "Hi", "model": "other"}, 404, "model"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ],
)
def test_tokenization_bad_requests(cli_server, path, body, status, param):
    r = requests.post(
        f"{cli_server.url}{path}", data=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=60
    )
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert_serving(cli_server)
