"""What the benchmarks share: argument tables, JSON result files, and the serving metrics and result table
(vLLM's ``calculate_metrics`` and ``benchmark_utils.py``)."""

from __future__ import annotations

import argparse
import json
import math
import warnings
from types import SimpleNamespace
from typing import Any

import numpy as np

# metric -> (short name, table header), in the order of the result table
METRICS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
PERCENTILE_METRICS, GOODPUT_METRICS = list(METRICS), ["ttft", "tpot", "e2el"]


def add_arguments(parser: argparse._ActionsContainer, rows: list[tuple]) -> None:
    """Add ``(flag, default, help[, more argparse keywords])`` rows. The default gives the type; a type in
    its place means no default, and ``False`` makes a switch."""
    for flag, default, text, *more in rows:
        kwargs = dict(type=default) if isinstance(default, type) else dict(default=default, type=type(default))
        kwargs = dict(action="store_true") if default is False else kwargs
        parser.add_argument(flag, help=text, **kwargs | (more[0] if more else {}))


def write_to_json(filename: str, records: Any, indent: int | None = None) -> None:
    def clear_inf(o: Any) -> Any:  # JSON has no infinity: vLLM writes infinite floats (request_rate) as "inf"
        if isinstance(o, dict | list):
            return {k: clear_inf(v) for k, v in o.items()} if isinstance(o, dict) else [clear_inf(v) for v in o]
        return "inf" if isinstance(o, float) and math.isinf(o) else o

    with open(filename, "w", encoding="utf-8") as f:
        json.dump(clear_inf(records), f, indent=indent)


def calculate_metrics(requests, outputs, dur_s, tokenizer, selected_metrics, percentiles, goodput_slos):
    """vLLM's metrics (ms; ``mean_ttft_ms``, ``percentiles_ttft_ms`` [(p, value)], ...) of the per-request
    outputs (s), and the output length of each request (0 for failed ones); ``goodput_slos``: {metric: ms}."""
    done = [(r, o) for r, o in zip(requests, outputs) if o.success]
    if not done:
        warnings.warn("All requests failed. This is likely due to a misconfiguration of the benchmark.", stacklevel=2)
    # without a count from the server, count the text's tokens (len(itl) undercounts multi-token chunks)
    count = {
        id(o): o.output_tokens or len(tokenizer(o.generated_text, add_special_tokens=False).input_ids) for _, o in done
    }
    output_lens = [count.get(id(o), 0) for o in outputs]
    # a request with at most one output token has no TPOT; it counts as 0 for goodput
    tpots = [(o.latency - o.ttft) / (count[id(o)] - 1) if count[id(o)] > 1 else 0.0 for _, o in done]
    per_request = {"ttft": [o.ttft for _, o in done], "tpot": tpots, "e2el": [o.latency for _, o in done]}
    good = np.ones(len(done), dtype=bool)
    for name, slo_ms in goodput_slos.items():
        good &= np.asarray(per_request[name]) <= slo_ms / 1000
    per_request["tpot"] = [t for (_, o), t in zip(done, tpots) if count[id(o)] > 1]
    per_request["itl"] = [t for _, o in done for t in o.itl]
    stats: dict[str, Any] = {}
    for name in METRICS:
        data = np.asarray(per_request[name] or [0.0]) * 1000  # nothing measured (e.g. no ITLs) reports 0
        for stat, f in (("mean", np.mean), ("median", np.median), ("std", np.std)):
            stats[f"{stat}_{name}_ms"] = float(f(data))
        stats[f"percentiles_{name}_ms"] = [(p, float(np.percentile(data, p))) for p in percentiles]
    total_input, total_output = sum(r.prompt_len for r, _ in done), sum(output_lens)
    metrics = SimpleNamespace(completed=len(done), total_input=total_input, total_output=total_output, **stats)
    per_s = dict(request=len(done), output=total_output, total_token=total_input + total_output)
    vars(metrics).update({f"{key}_throughput": n / dur_s for key, n in per_s.items()})
    metrics.request_goodput = (int(good.sum()) if goodput_slos else 0) / dur_s
    return metrics, output_lens


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
        values = {f"{stat}_{name}_ms": getattr(m, f"{stat}_{name}_ms") for stat in ("mean", "median", "std")}
        values |= {f"p{p:g}_{name}_ms": v for p, v in getattr(m, f"percentiles_{name}_ms")}  # p99, p99.9
        result.update(values)
        for key, value in values.items():
            if not key.startswith("std_"):  # "p99.9_ttft_ms" -> "P99.9 TTFT (ms):"
                print(f"{key.split('_')[0].capitalize() + ' ' + short + ' (ms):':<40} {value:<10.2f}")
    print("=" * 50)
    return result
