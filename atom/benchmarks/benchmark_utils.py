"""What the benchmarks share: argument tables, JSON result files, and the serving metrics and result table
(vLLM's ``calculate_metrics`` and ``benchmark_utils.py``)."""

from __future__ import annotations

import argparse
import json
import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

# metric -> (short name, table header), in the order of the result table
METRICS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
PERCENTILE_METRICS = list(METRICS)
GOODPUT_METRICS = ["ttft", "tpot", "e2el"]


def add_arguments(parser: argparse._ActionsContainer, rows: list[tuple]) -> None:
    """Add ``(flag, default, help[, more argparse keywords])`` rows. The default gives the type; a type in
    its place means no default, and ``False`` makes a switch."""
    for flag, default, text, *more in rows:
        if default is False:
            kwargs = dict(action="store_true")
        elif isinstance(default, type):
            kwargs = dict(type=default)
        else:
            kwargs = dict(default=default, type=type(default))
        parser.add_argument(flag, help=text, **kwargs | (more[0] if more else {}))


def _clear_inf(o: Any) -> Any:
    """JSON has no infinity: infinite floats (e.g. request_rate) are written as "inf"."""
    if isinstance(o, dict):
        return {k: _clear_inf(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_clear_inf(v) for v in o]
    return "inf" if isinstance(o, float) and math.isinf(o) else o


def write_to_json(filename: str, records: Any, indent: int | None = None) -> None:
    with open(filename, "w", encoding="utf-8") as f:
        json.dump(_clear_inf(records), f, indent=indent)


@dataclass
class BenchmarkMetrics:
    completed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    # per metric of METRICS (e2el: end-to-end latency per request, measured on the client):
    # mean_X_ms, median_X_ms, std_X_ms and percentiles_X_ms, a list of (percentile, value)
    latencies: dict[str, Any]

    def __getattr__(self, name: str) -> Any:  # vLLM's flat names, e.g. metrics.mean_ttft_ms
        try:
            return self.__dict__["latencies"][name]
        except KeyError:
            raise AttributeError(name) from None


def calculate_metrics(requests, outputs, dur_s, tokenizer, selected_metrics, percentiles, goodput_slos):
    """Aggregate per-request outputs (seconds) into a ``BenchmarkMetrics`` (ms) and the output length of
    every request (0 for failed ones); ``goodput_slos`` maps a metric to its SLO in ms."""
    done = [(r, o) for r, o in zip(requests, outputs) if o.success]
    # without a count from the server, count the text's tokens (len(itl) undercounts multi-token chunks)
    lens = {
        id(o): o.output_tokens or len(tokenizer(o.generated_text, add_special_tokens=False).input_ids) for _, o in done
    }
    output_lens = [lens.get(id(o), 0) for o in outputs]
    # a request with at most one output token has no TPOT; it counts as 0 for goodput
    tpots = [(o.latency - o.ttft) / (lens[id(o)] - 1) if lens[id(o)] > 1 else 0.0 for _, o in done]
    per_request = {"ttft": [o.ttft for _, o in done], "tpot": tpots, "e2el": [o.latency for _, o in done]}
    good = np.ones(len(done), dtype=bool)
    for name, slo_ms in goodput_slos.items():
        good &= np.asarray(per_request[name]) <= slo_ms / 1000
    if not done:
        warnings.warn("All requests failed. This is likely due to a misconfiguration of the benchmark.", stacklevel=2)
    per_request["tpot"] = [t for (_, o), t in zip(done, tpots) if lens[id(o)] > 1]
    per_request["itl"] = [t for _, o in done for t in o.itl]
    stats: dict[str, Any] = {}
    for name in METRICS:
        data = np.asarray(per_request[name] or [0.0]) * 1000  # nothing measured (e.g. no ITLs) reports 0
        stats[f"mean_{name}_ms"], stats[f"median_{name}_ms"] = float(np.mean(data)), float(np.median(data))
        stats[f"std_{name}_ms"] = float(np.std(data))
        stats[f"percentiles_{name}_ms"] = [(p, float(np.percentile(data, p))) for p in percentiles]
    total_input, total_output = sum(r.prompt_len for r, _ in done), sum(output_lens)
    num_good = int(good.sum()) if goodput_slos else 0
    totals = (len(done), num_good, total_output, total_input + total_output)
    metrics = BenchmarkMetrics(len(done), total_input, total_output, *(n / dur_s for n in totals), stats)
    return metrics, output_lens


def percentile_key(p: float) -> str:
    """ "99" for 99.0, "99.9" for 99.9: the name used in P99 and p99_ttft_ms."""
    return str(int(p)) if int(p) == p else str(p)


def print_and_collect_results(metrics, duration, outputs, output_lens, selected_metrics, goodput_slos) -> dict:
    """Print vLLM's result table (the program's output, hence print) and return the result dictionary."""
    m = metrics
    table = [
        ("Successful requests:", "completed", m.completed),
        ("Benchmark duration (s):", "duration", duration),
        ("Total input tokens:", "total_input_tokens", m.total_input),
        ("Total generated tokens:", "total_output_tokens", m.total_output),
        ("Request throughput (req/s):", "request_throughput", m.request_throughput),
        ("Request goodput (req/s):", "request_goodput", m.request_goodput if goodput_slos else None),
        ("Output token throughput (tok/s):", "output_throughput", m.output_throughput),
        ("Total Token throughput (tok/s):", "total_token_throughput", m.total_token_throughput),
    ]
    result: dict[str, Any] = {"duration": duration} | {key: value for _, key, value in table}
    result.update(input_lens=[o.prompt_len for o in outputs], output_lens=output_lens, ttfts=[o.ttft for o in outputs])
    result.update(itls=[o.itl for o in outputs], generated_texts=[o.generated_text for o in outputs])
    result["errors"] = [o.error for o in outputs]
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    for label, _, value in table:
        if value is not None:  # no goodput without --goodput
            print(f"{label:<40} {value:<10}" if isinstance(value, int) else f"{label:<40} {value:<10.2f}")
    for name, (short, header) in METRICS.items():
        if name not in selected_metrics:
            continue
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        values = {f"{stat}_{name}_ms": m.latencies[f"{stat}_{name}_ms"] for stat in ("mean", "median", "std")}
        values |= {f"p{percentile_key(p)}_{name}_ms": v for p, v in m.latencies[f"percentiles_{name}_ms"]}
        result.update(values)
        for key, value in values.items():
            if not key.startswith("std_"):  # "p99.9_ttft_ms" -> "P99.9 TTFT (ms):"
                print(f"{key.split('_')[0].capitalize() + ' ' + short + ' (ms):':<40} {value:<10.2f}")
    print("=" * 50)
    return result
