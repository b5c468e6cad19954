"""A real server with ``-dp 2 --enable-dp-attention`` on the tiny Qwen3-MoE: concurrent
greedy completions through the official ``openai`` client equal one engine's, every KV
block is free afterwards, and SIGTERM stops the server and both replicas cleanly (a
replica leaving takes the other out of their lockstep)."""

import asyncio

import openai
import psutil
from server_process import MAX_MODEL_LEN, ServerProcess, assert_all_blocks_free, wait_until

from atom import LLMEngine, SamplingParams
from atom.testing.tiny_checkpoint import build

PROMPTS = ["Once upon a time, a small model learned to count", "The quick brown fox", "def add(a, b):",
           "Paged attention stores keys", "机器学习 🙂"]
MAX_TOKENS = [16, 3, 9, 1, 12]


def test_dp_attention_server_matches_one_engine(tmp_path):
    model = build(str(tmp_path / "moe"), arch="qwen3_moe")
    ref = LLMEngine(model, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=32 << 20)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    expected = [o["text"] for o in ref.generate(PROMPTS, params, use_tqdm=False)]
    srv = ServerProcess(model, tmp_path, extra_args=("-dp", "2", "--enable-dp-attention"))
    try:
        replicas = [p for p in psutil.Process(srv.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(replicas) == 2

        async def one(aclient, prompt, n):
            out = await aclient.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0)
            return out.choices[0].text

        async def run_all():
            async with openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0,
                                          timeout=300) as aclient:
                return await asyncio.gather(*(one(aclient, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)))

        assert asyncio.run(run_all()) == expected
        assert_all_blocks_free(srv)
        assert "data-parallel attention: replica 1 of 2" in srv.log()
        assert srv.stop() == 0
        assert wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in replicas),
                          15)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
