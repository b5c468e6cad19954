"""The server's periodic stats line, as vLLM's ``LoggingStatLogger`` prints it every
``VLLM_LOG_STATS_INTERVAL`` seconds (``--disable-log-stats`` turns it off): prompt and
generation throughput over the interval, running and waiting requests, KV-cache usage and the
prefix-cache hit rate. An idle interval (no tokens in it or the one before) logs at DEBUG."""

from __future__ import annotations

import asyncio
import logging
import os
import time

from atom.engine.async_llm import AsyncLLM
from atom.engine.outputs import EngineStats

logger = logging.getLogger("atom.entrypoints.openai.stat_logger")

DEFAULT_INTERVAL_S = 10.0


def log_stats_interval() -> float:
    """vLLM's ``VLLM_LOG_STATS_INTERVAL`` (seconds, default 10; it must be positive)."""
    value = float(os.environ.get("VLLM_LOG_STATS_INTERVAL", DEFAULT_INTERVAL_S))
    if value <= 0:
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL must be positive, got {value}")
    return value


class StatLogger:
    """Throughput from the engine's token counters between two ``log`` calls."""

    def __init__(self, engine: AsyncLLM):
        self.engine = engine
        self.last_time = time.monotonic()
        self.last_tokens = (engine.num_prompt_tokens, engine.num_generation_tokens)
        self.last_prefix = (0, 0)  # prefix-cache queries and hits at the last log
        self.last_throughput = (0.0, 0.0)

    def log(self, stats: EngineStats | None) -> None:
        now = time.monotonic()
        tokens = (self.engine.num_prompt_tokens, self.engine.num_generation_tokens)
        elapsed = max(now - self.last_time, 1e-9)
        throughput = tuple((b - a) / elapsed for a, b in zip(self.last_tokens, tokens))
        idle = not any(throughput) and not any(self.last_throughput)
        self.last_time, self.last_tokens, self.last_throughput = now, tokens, throughput
        parts = ["Avg prompt throughput: %.1f tokens/s", "Avg generation throughput: %.1f tokens/s"]
        args: list[float | int] = list(throughput)
        if stats is not None:
            parts += ["Running: %d reqs", "Waiting: %d reqs"]
            args += [stats.num_running, stats.num_waiting]
            if stats.num_preemptions:
                parts.append("Preemptions: %d")
                args.append(stats.num_preemptions)
            queries = stats.prefix_cache_queries - self.last_prefix[0]
            hits = stats.prefix_cache_hits - self.last_prefix[1]
            self.last_prefix = (stats.prefix_cache_queries, stats.prefix_cache_hits)
            parts += ["GPU KV cache usage: %.1f%%", "Prefix cache hit rate: %.1f%%"]
            args += [stats.kv_cache_usage * 100, 100 * hits / queries if queries else 0.0]
        (logger.debug if idle else logger.info)(", ".join(parts), *args)

    async def run(self, interval: float) -> None:
        """Log every ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval)
            if self.engine.is_healthy:
                self.log(await self.engine.get_stats(fresh=False))
