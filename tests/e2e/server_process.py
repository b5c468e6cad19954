"""A real atom server in a subprocess on 127.0.0.1 (free port), for the end-to-end tests."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests
from prometheus_client.parser import text_string_to_metric_families

MAX_MODEL_LEN = 512
STARTUP_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m atom.entrypoints.openai_server`` in a subprocess, float32 on the CPU;
    ``model=None`` starts it with no model (the embedded default)."""

    def __init__(self, model: str | None, workdir: Path, api_key: str | None = None, extra_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, via_cli: bool = False, own_group: bool = False):
        self.model = model
        self.api_key = api_key
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.profiler_dir = workdir / "traces"
        self.log_path = workdir / "server.log"
        # via_cli: ``atom serve MODEL`` (the console script's entry point), else ``--model MODEL``
        entry = ["atom.entrypoints.cli", "serve", *([model] if model else [])] if via_cli else [
            "atom.entrypoints.openai_server", *(["--model", model] if model else [])]
        cmd = [
            sys.executable, "-m", *entry, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes", str(32 << 20),
            "--disable-uvicorn-access-log", "--torch-profiler-dir", str(self.profiler_dir),
            "--shutdown-timeout", "20", *(["--api-key", api_key] if api_key else []), *extra_args,
        ]
        with open(self.log_path, "w") as log:
            # own_group: a process group of its own (as a service manager starts it), for tests that signal it
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=own_group)
        self._wait_ready()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-5000:]}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        self.proc.kill()
        raise RuntimeError(f"server did not start in {STARTUP_TIMEOUT_S} s:\n{self.log()[-5000:]}")

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def engine_core(self) -> psutil.Process:
        # a direct child: with -tp the core's own rank processes are spawned too
        [core] = [p for p in psutil.Process(self.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        return core

    def post(self, path: str, body: dict, **kwargs) -> requests.Response:
        return requests.post(f"{self.url}{path}", json=body, headers=self.headers, timeout=60, **kwargs)

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        """Every ``atom:*`` sample of /metrics as (name, labels, value)."""
        text = requests.get(f"{self.url}/metrics", timeout=30).text
        return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
                for s in family.samples if s.name.startswith("atom:")]

    def metrics(self) -> dict[str, float]:
        """``atom:*`` samples of /metrics by name, summed over the engines (data-parallel
        replicas); of a name's other label sets (finish reasons, buckets) the last wins. Ratios
        (KV usage, acceptance rate) add up too: read them per engine under -dp."""
        summed: dict[tuple[str, tuple], float] = {}
        for name, labels, value in self.samples():
            key = (name, tuple(sorted((k, v) for k, v in labels.items() if k != "engine")))
            summed[key] = summed.get(key, 0.0) + value
        return {name: value for (name, _), value in summed.items()}

    def per_engine(self, name: str, **labels: str) -> dict[str, float]:
        """One metric's samples by ``engine`` label, summed over the others (those with ``labels``)."""
        result: dict[str, float] = {}
        for sample_name, sample_labels, value in self.samples():
            if sample_name == name and labels.items() <= sample_labels.items():
                result[sample_labels["engine"]] = result.get(sample_labels["engine"], 0.0) + value
        return result

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, as a process manager would; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode


def wait_until(predicate, timeout: float, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def assert_all_blocks_free(server: ServerProcess, timeout: float = 15.0) -> None:
    def idle():
        m = server.metrics()
        return m if (m["atom:num_requests_running"] == 0 and m["atom:num_requests_waiting"] == 0
                     and m["atom:num_free_kv_blocks"] == m["atom:num_kv_blocks"]) else None

    assert wait_until(idle, timeout), f"engine not idle: {server.metrics()}"


def assert_serving(server: ServerProcess) -> None:
    r = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    assert requests.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
