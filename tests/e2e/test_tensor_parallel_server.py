"""A real server with -tp 2 (the engine-core process starts two rank processes, gloo on
the CPU): a greedy completion equals one rank's; then a killed rank makes /health report
the engine dead in one line, and the server exits cleanly with no process left behind."""

import signal

import psutil
import requests
from server_process import MAX_MODEL_LEN, wait_until

from atom import LLMEngine, SamplingParams

PROMPT = "Once upon a time, a small model learned to count"
MAX_TOKENS = 16


def test_tp2_server_matches_one_rank_then_survives_a_rank_death(make_server, tiny_model):
    ref = LLMEngine(tiny_model, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
                    kv_cache_memory_bytes=32 << 20)
    [expected] = ref.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    srv = make_server(extra_args=("-tp", "2"))
    r = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == expected["text"]

    core = srv.engine_core()
    ranks = core.children()
    assert len(ranks) == 2
    ranks[1].send_signal(signal.SIGKILL)
    # the next step finds the rank dead
    r = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert wait_until(lambda: requests.get(f"{srv.url}/health").status_code == 503, timeout=10)
    message = requests.get(f"{srv.url}/health").json()["error"]["message"]
    assert "rank" in message and "died" in message and "\n" not in message
    everyone = [core, *ranks]
    assert srv.stop() == 0
    assert wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in everyone), 15)
