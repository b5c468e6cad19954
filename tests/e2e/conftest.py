"""Fixtures of the end-to-end tests: a tiny checkpoint and real server subprocesses."""

from __future__ import annotations

import os

import pytest
from server_process import ServerProcess

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from atom.testing.tiny_checkpoint import build

    return build(str(tmp_path_factory.mktemp("tiny-qwen3")), arch="qwen3")


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = ServerProcess(tiny_model, tmp_path_factory.mktemp("server"))
    yield srv
    srv.stop()


@pytest.fixture
def make_server(tiny_model, tmp_path):
    """Servers for tests that kill them; stopped (or killed) at the end of the test."""
    servers = []

    def make(**kwargs) -> ServerProcess:
        workdir = tmp_path / f"server{len(servers)}"
        workdir.mkdir()
        srv = ServerProcess(tiny_model, workdir, **kwargs)
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
