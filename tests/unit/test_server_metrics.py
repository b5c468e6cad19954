"""``ServerMetrics`` (``GET /metrics``): as vLLM's, every metric is labelled ``model_name`` and
``engine`` (the data-parallel replica); each replica's gauges come from its own stats, each
finished request counts for the replica that ran it, and every replica shows zeros from the start."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from atom.engine.output_processor import RequestOutput
from atom.engine.outputs import EngineStats
from atom.entrypoints.openai.metrics import ServerMetrics
from atom.spec_decode.stats import SpecDecodeStats


def by_engine(metrics: ServerMetrics, name: str, **labels: str) -> dict[str, float]:
    """``name``'s samples by engine (those with ``labels``)."""
    return {s.labels["engine"]: s.value for f in text_string_to_metric_families(metrics.render().decode())
            for s in f.samples if s.name == name and labels.items() <= s.labels.items()}


def stats(num_running: int, num_blocks: int, spec: SpecDecodeStats | None = None) -> EngineStats:
    return EngineStats(num_running, 0, 0.5, num_blocks // 2, num_blocks, 0, 0, 0, spec)


def finished(engine_index: int, finish_reason: str = "stop") -> RequestOutput:
    return RequestOutput("r", None, [1, 2, 3], [4, 5], "", [], "", True, finish_reason, latency=0.3, ttft=0.1,
                         tpot=0.2, engine_index=engine_index)


def test_every_metric_has_both_labels_and_each_engine_starts_at_zero():
    metrics = ServerMetrics("m", num_engines=2)
    samples = [s for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples]
    assert samples and all(s.labels["model_name"] == "m" for s in samples)
    assert {s.labels["engine"] for s in samples} == {"0", "1"}
    assert by_engine(metrics, "atom:num_kv_blocks") == {"0": 0.0, "1": 0.0}
    assert by_engine(metrics, "atom:prompt_tokens_total") == {"0": 0.0, "1": 0.0}
    assert by_engine(ServerMetrics("m"), "atom:num_requests_running") == {"0": 0.0}  # one engine: "0"
    for reason in ("stop", "length", "abort", "error"):  # each finish reason's series, as vLLM's
        assert by_engine(metrics, "atom:request_success_total", finished_reason=reason) == {"0": 0.0, "1": 0.0}


def test_gauges_per_replica_from_its_own_stats():
    metrics = ServerMetrics("m", num_engines=2)
    metrics.set_engine_stats(0, stats(num_running=3, num_blocks=100))
    metrics.set_engine_stats(1, stats(num_running=1, num_blocks=60, spec=SpecDecodeStats(4, 8, 6, [4, 4], [4, 2])))
    assert by_engine(metrics, "atom:num_requests_running") == {"0": 3.0, "1": 1.0}
    assert by_engine(metrics, "atom:num_kv_blocks") == {"0": 100.0, "1": 60.0}
    assert by_engine(metrics, "atom:num_free_kv_blocks") == {"0": 50.0, "1": 30.0}
    assert by_engine(metrics, "atom:spec_decode_num_draft_tokens") == {"0": 0.0, "1": 8.0}
    assert by_engine(metrics, "atom:spec_decode_num_accepted_tokens_per_pos", position="1") == {"1": 2.0}


def test_finished_request_counts_for_the_replica_that_ran_it():
    metrics = ServerMetrics("m", num_engines=2)
    metrics.observe_finished(finished(engine_index=1))
    metrics.observe_finished(finished(engine_index=1, finish_reason="abort"))
    metrics.observe_finished(finished(engine_index=0, finish_reason="length"))
    assert by_engine(metrics, "atom:request_success_total", finished_reason="stop") == {"0": 0.0, "1": 1.0}
    assert by_engine(metrics, "atom:request_success_total", finished_reason="abort") == {"0": 0.0, "1": 1.0}
    assert by_engine(metrics, "atom:request_success_total", finished_reason="length") == {"0": 1.0, "1": 0.0}
    assert by_engine(metrics, "atom:request_success_total", finished_reason="error") == {"0": 0.0, "1": 0.0}
    assert by_engine(metrics, "atom:prompt_tokens_total") == {"0": 3.0, "1": 6.0}
    assert by_engine(metrics, "atom:generation_tokens_total") == {"0": 2.0, "1": 4.0}
    assert by_engine(metrics, "atom:e2e_request_latency_seconds_count") == {"0": 1.0, "1": 2.0}
    assert by_engine(metrics, "atom:time_per_output_token_seconds_count") == {"0": 1.0, "1": 2.0}
