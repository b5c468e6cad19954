"""What a vLLM user expects in the server log: the periodic stats line every
``VLLM_LOG_STATS_INTERVAL`` seconds (off with ``--disable-log-stats``) and, with
``--enable-log-requests``, a line per request with its sampling parameters."""

from __future__ import annotations

import os
import re
import time

import openai
from server_process import ServerProcess


def complete(srv: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
    client.completions.create(model=srv.model, prompt=[5, 6, 7, 8], max_tokens=24, temperature=0,
                              extra_body={"ignore_eos": True})  # fmt: skip


def test_stats_line_and_request_log(tiny_model, tmp_path):
    env = {**os.environ, "VLLM_LOG_STATS_INTERVAL": "0.5"}
    srv = ServerProcess(tiny_model, tmp_path, env=env, extra_args=("--enable-log-requests",))
    try:
        complete(srv)
        deadline = time.time() + 30
        while time.time() < deadline and not re.search(r"Avg generation throughput: [1-9]", srv.log()):
            time.sleep(0.2)
        log = srv.log()
        assert re.search(r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [1-9][\d.]* tokens/s, "
                         r"Running: \d+ reqs, Waiting: \d+ reqs, GPU KV cache usage: [\d.]+%, "
                         r"Prefix cache hit rate: [\d.]+%", log), log[-3000:]
        assert re.search(r"Received request cmpl-\w+-0 \(n=1\): prompt of 4 tokens, params: SamplingParams\(", log)
    finally:
        srv.stop()


def test_disable_log_stats(tiny_model, tmp_path):
    env = {**os.environ, "VLLM_LOG_STATS_INTERVAL": "0.2"}
    srv = ServerProcess(tiny_model, tmp_path, env=env, extra_args=("--disable-log-stats",))
    try:
        complete(srv)
        time.sleep(1.0)  # five intervals
        assert "Avg prompt throughput" not in srv.log()
        assert "Received request" not in srv.log()  # request logging is off unless asked
    finally:
        srv.stop()
