"""A real server with -dp 2 (two engine-core processes, each a full replica): concurrent
greedy completions through the official ``openai`` client equal one engine's; /metrics
labels each replica's gauges and the requests it ran with its ``engine`` index, its KV
blocks add up to both replicas', all free afterwards, also after a client that hangs up;
then a killed replica makes /health report the engine dead in one line, and the server
exits cleanly with no process left behind."""

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
ENGINE_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_free_kv_blocks",
                 "num_kv_blocks", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
                 "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                 "spec_decode_acceptance_rate", "spec_decode_mean_accepted_length")


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
    check_per_engine_metrics(srv, 2 * ref.core.block_manager.num_blocks)
    check_killed_client_frees_blocks(srv)  # the abort reaches the replica that runs the request

    replicas[1].send_signal(signal.SIGKILL)
    assert wait_until(lambda: requests.get(f"{srv.url}/health").status_code == 503, timeout=15)
    message = requests.get(f"{srv.url}/health").json()["error"]["message"]
    assert "data-parallel replica 1" in message and "\n" not in message
    r = srv.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert srv.stop() == 0
    assert wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in replicas), 15)


def check_per_engine_metrics(srv, num_blocks: int) -> None:
    """Each replica's gauges under its own ``engine`` label; each finished request counted
    once, for the replica that ran it (the balancer spreads concurrent requests over both)."""
    for name in ENGINE_GAUGES:
        assert set(srv.per_engine(f"atom:{name}")) == {"0", "1"}, name
    blocks = srv.per_engine("atom:num_kv_blocks")
    assert sum(blocks.values()) == num_blocks and blocks["0"] == blocks["1"]  # identical replicas
    assert srv.per_engine("atom:num_free_kv_blocks") == blocks  # all free again
    served = srv.per_engine("atom:request_success_total")
    assert sum(served.values()) == len(PROMPTS) and served["0"] > 0 and served["1"] > 0, served
    # a request's latency and tokens count for the same replica as its success
    assert srv.per_engine("atom:e2e_request_latency_seconds_count") == served
    assert all(srv.per_engine("atom:generation_tokens_total")[engine] > 0 for engine in served)
