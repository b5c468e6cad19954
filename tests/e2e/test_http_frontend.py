"""vLLM's HTTP front-end flags on a real server: ``VLLM_API_KEY`` (when neither --api-key nor
ATOM_API_KEY is set), CORS origins, no API docs, a proxy's root path; vLLM's ``/ping`` and
``/version`` routes; LoRA flags refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import requests
from server_process import ServerProcess

import atom


@pytest.fixture(scope="module")
def frontend_server(tiny_model, tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "ATOM_API_KEY"} | {"VLLM_API_KEY": "sekret"}
    args = ("--allowed-origins", '["http://ok.example"]', "--disable-fastapi-docs", "--root-path", "/proxy")
    srv = ServerProcess(tiny_model, tmp_path_factory.mktemp("frontend"), extra_args=args, env=env)
    yield srv
    srv.stop()


def test_vllm_api_key_guards_the_api(frontend_server):
    url = frontend_server.url
    assert requests.get(f"{url}/v1/models", timeout=30).status_code == 401
    ok = requests.get(f"{url}/v1/models", headers={"Authorization": "Bearer sekret"}, timeout=30)
    assert ok.status_code == 200 and ok.json()["data"]


def test_ping_and_version_answer_without_a_key(frontend_server):
    url = frontend_server.url
    assert requests.get(f"{url}/ping", timeout=30).status_code == 200
    assert requests.post(f"{url}/ping", timeout=30).status_code == 200
    assert requests.get(f"{url}/version", timeout=30).json() == {"version": atom.__version__}
    assert requests.get(f"{url}/proxy/ping", timeout=30).status_code == 200  # under --root-path too


def test_docs_disabled(frontend_server):
    key = {"Authorization": "Bearer sekret"}
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert requests.get(f"{frontend_server.url}{path}", headers=key, timeout=30).status_code == 404, path


def test_cors_allows_only_the_given_origins(frontend_server):
    def preflight(origin: str) -> requests.Response:
        headers = {"Origin": origin, "Access-Control-Request-Method": "POST"}
        return requests.options(f"{frontend_server.url}/v1/completions", headers=headers, timeout=30)

    ok = preflight("http://ok.example")
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://ok.example"
    refused = preflight("http://other.example")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers


def test_lora_flags_refused_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "atom.entrypoints.openai_server", "--lora-modules", "a=/x"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "atom serve: error: --lora-modules: LoRA adapters are not supported by atom"


def test_help_never_prints_the_environment_key():
    env = os.environ | {"VLLM_API_KEY": "sekret", "ATOM_API_KEY": "sekret2"}
    proc = subprocess.run([sys.executable, "-m", "atom.entrypoints.openai_server", "--help"], capture_output=True,
                          text=True, timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 0 and "--api-key" in proc.stdout and "sekret" not in proc.stdout
