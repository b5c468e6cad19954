"""A real server with -dp 2 (two engine-core processes, each a full replica): concurrent
greedy completions through the official ``openai`` client equal one engine's; the merged
/metrics count both replicas' KV blocks, all free afterwards, also after a client that
hangs up; then a killed replica makes /health report the engine dead in one line, and the
server exits cleanly with no process left behind."""

import asyncio
import signal

import openai
import psutil
import requests
from server_process import MAX_MODEL_LEN, assert_all_blocks_free, wait_until
from test_openai_server import check_killed_client_frees_blocks

from atom import LLMEngine, SamplingParams

PROMPTS = ["Once upon a time, a small model learned to count", "The quick brown fox", "def add(a, b):",
           "Paged attention stores keys", "机器学习 🙂", "The capital of France is"] * 2
MAX_TOKENS = 16


def test_dp2_server_serves_concurrently_then_survives_a_replica_death(make_server, tiny_model):
    ref = LLMEngine(tiny_model, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
                    kv_cache_memory_bytes=32 << 20)
    expected = [o["text"] for o in ref.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                                use_tqdm=False)]
    srv = make_server(extra_args=("-dp", "2"))
    replicas = [p for p in psutil.Process(srv.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(replicas) == 2

    async def one(aclient, prompt):
        out = await aclient.completions.create(model=tiny_model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return out.choices[0].text

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in PROMPTS))

    assert asyncio.run(run_all()) == expected
    assert_all_blocks_free(srv)
    assert srv.metrics()["atom:num_kv_blocks"] == 2 * ref.core.block_manager.num_blocks  # both replicas'
    check_killed_client_frees_blocks(srv)  # the abort reaches the replica that runs the request

    replicas[1].send_signal(signal.SIGKILL)
    assert wait_until(lambda: requests.get(f"{srv.url}/health").status_code == 503, timeout=15)
    message = requests.get(f"{srv.url}/health").json()["error"]["message"]
    assert "data-parallel replica 1" in message and "\n" not in message
    r = srv.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert srv.stop() == 0
    assert wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in replicas), 15)
