"""The server's periodic stats line (vLLM's format): throughput from the engine's token
counters over the interval, the core's running / waiting requests, KV-cache usage and the
prefix-cache hit rate of the interval; idle intervals log at DEBUG."""

from __future__ import annotations

import logging

import pytest

from atom.engine.outputs import EngineStats
from atom.entrypoints.openai import stat_logger
from atom.entrypoints.openai.stat_logger import StatLogger


class FakeEngine:
    is_healthy = True
    num_prompt_tokens = 0
    num_generation_tokens = 0


def stats(queries: int, hits: int, preemptions: int = 0) -> EngineStats:
    return EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, num_free_blocks=30, num_blocks=40,
                       num_preemptions=preemptions, prefix_cache_queries=queries, prefix_cache_hits=hits)


def test_throughput_and_state(monkeypatch, caplog):
    clock = iter([100.0, 102.0, 104.0, 106.0, 108.0])
    monkeypatch.setattr(stat_logger.time, "monotonic", lambda: next(clock))
    engine = FakeEngine()
    logger = StatLogger(engine)  # t = 100
    engine.num_prompt_tokens, engine.num_generation_tokens = 400, 100
    with caplog.at_level(logging.DEBUG, logger="atom.entrypoints.openai.stat_logger"):
        logger.log(stats(queries=10, hits=4))  # t = 102
        logger.log(stats(queries=20, hits=14, preemptions=1))  # t = 104, no tokens (the last interval had some)
        logger.log(stats(queries=20, hits=14))  # t = 106: idle
    first, second, third = caplog.records
    assert first.levelno == logging.INFO and first.getMessage() == (
        "Avg prompt throughput: 200.0 tokens/s, Avg generation throughput: 50.0 tokens/s, Running: 3 reqs, "
        "Waiting: 2 reqs, GPU KV cache usage: 25.0%, Prefix cache hit rate: 40.0%")
    assert second.levelno == logging.INFO and "generation throughput: 0.0 tokens/s" in second.getMessage()
    assert "Preemptions: 1" in second.getMessage() and "hit rate: 100.0%" in second.getMessage()
    assert third.levelno == logging.DEBUG and "hit rate: 0.0%" in third.getMessage()


def test_interval_from_vllms_variable(monkeypatch):
    monkeypatch.delenv("VLLM_LOG_STATS_INTERVAL", raising=False)
    assert stat_logger.log_stats_interval() == 10.0
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "2.5")
    assert stat_logger.log_stats_interval() == 2.5
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0")
    with pytest.raises(ValueError, match="must be positive"):
        stat_logger.log_stats_interval()
