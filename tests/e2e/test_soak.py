"""Soak: 1,000 concurrent streaming requests against one server, 10% of the clients hanging
up mid-stream. Every stream that is read to the end must be complete and error-free, and
afterwards no KV block may be left in use. Out of the default run (marked ``slow``):

    python -m pytest tests/e2e/test_soak.py -m slow -s
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import pytest
from server_process import assert_all_blocks_free, assert_serving

NUM_REQUESTS = 1000
DISCONNECT_FRACTION = 0.1


async def one_stream(session: aiohttp.ClientSession, url: str, i: int, hang_up_after: int | None) -> dict:
    max_tokens = 4 + i % 29
    body = {
        "prompt": f"Request {i}: once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.8,
        "seed": i,
        "stream": True,
    }
    events = []
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            return {"status": r.status, "body": await r.text()}
        async for line in r.content:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
                if hang_up_after is not None and len(events) >= hang_up_after:
                    r.close()  # the client goes away mid-stream
                    return {"status": "disconnected"}
    return {"status": 200, "events": events, "max_tokens": max_tokens}


async def soak(url: str) -> list[dict]:
    rng = random.Random(0)
    hang_ups = {i: rng.randint(1, 3) for i in rng.sample(range(NUM_REQUESTS), int(NUM_REQUESTS * DISCONNECT_FRACTION))}
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        return await asyncio.gather(*(one_stream(session, url, i, hang_ups.get(i)) for i in range(NUM_REQUESTS)))


def check_complete(result: dict) -> None:
    events = result["events"]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], [c for c in chunks if "error" in c][:1]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices[-1]["finish_reason"] == "length"
    assert all(c["finish_reason"] is None for c in choices[:-1])


@pytest.mark.slow
def test_1000_concurrent_streams_with_disconnects(server):
    start = time.monotonic()
    results = asyncio.run(soak(server.url))
    seconds = time.monotonic() - start
    completed = [r for r in results if r["status"] == 200]
    disconnected = [r for r in results if r["status"] == "disconnected"]
    failed = [r for r in results if r["status"] not in (200, "disconnected")]
    assert not failed, failed[:3]
    assert len(disconnected) == NUM_REQUESTS * DISCONNECT_FRACTION
    for r in completed:
        check_complete(r)
    assert_all_blocks_free(server, timeout=60)
    m = server.metrics()
    print(
        f"soak: {len(completed)} streams completed, {len(disconnected)} disconnected, 0 errors, "
        f"{seconds:.1f} s; KV blocks free {m['atom:num_free_kv_blocks']:.0f}/{m['atom:num_kv_blocks']:.0f}"
    )
    assert_serving(server)
