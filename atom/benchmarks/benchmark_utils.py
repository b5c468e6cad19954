"""Serving metrics and result files (vLLM's ``calculate_metrics``, result table and ``benchmark_utils.py``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from atom.benchmarks.backend_request_func import RequestFuncOutput
from atom.benchmarks.datasets import SampleRequest

# metric -> (short name, table header); the order of the result table
METRICS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
PERCENTILE_METRICS = list(METRICS)
GOODPUT_METRICS = ["ttft", "tpot", "e2el"]


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


def calculate_metrics(input_requests: list[SampleRequest], outputs: list[RequestFuncOutput], dur_s: float,
                      tokenizer: PreTrainedTokenizerBase, selected_percentile_metrics: list[str],
                      selected_percentiles: list[float], goodput_config_dict: dict[str, float],
                      ) -> tuple[BenchmarkMetrics, list[int]]:
    """Aggregate per-request outputs (seconds) into metrics (ms); also the output length of every
    request (0 for failed ones)."""
    done = [(r, o) for r, o in zip(input_requests, outputs) if o.success]
    # without a count from the server, count the text's tokens (len(itl) undercounts multi-token chunks)
    lens = {id(o): o.output_tokens or len(tokenizer(o.generated_text, add_special_tokens=False).input_ids)
            for _, o in done}
    actual_output_lens = [lens.get(id(o), 0) for o in outputs]
    # a request with at most one output token has no TPOT; it counts as 0 for goodput
    all_tpots = [(o.latency - o.ttft) / (lens[id(o)] - 1) if lens[id(o)] > 1 else 0.0 for _, o in done]
    per_request = {"ttft": [o.ttft for _, o in done], "tpot": all_tpots, "e2el": [o.latency for _, o in done],
                   "itl": [t for _, o in done for t in o.itl]}
    good = np.ones(len(done), dtype=bool)
    for name, slo_ms in goodput_config_dict.items():
        good &= np.asarray(per_request[name]) <= slo_ms / 1000
    if not done:
        warnings.warn("All requests failed. This is likely due to a misconfiguration on the benchmark arguments.",
                      stacklevel=2)
    per_request["tpot"] = [t for (_, o), t in zip(done, all_tpots) if lens[id(o)] > 1]
    stats: dict[str, Any] = {}
    for name in METRICS:
        data = np.asarray(per_request[name] or [0.0]) * 1000  # nothing measured (e.g. no ITLs) reports 0
        stats.update({f"mean_{name}_ms": float(np.mean(data)), f"median_{name}_ms": float(np.median(data)),
                      f"std_{name}_ms": float(np.std(data)),
                      f"percentiles_{name}_ms": [(p, float(np.percentile(data, p))) for p in selected_percentiles]})
    total_input, total_output = sum(r.prompt_len for r, _ in done), sum(actual_output_lens)
    metrics = BenchmarkMetrics(
        completed=len(done), total_input=total_input, total_output=total_output,
        request_throughput=len(done) / dur_s,
        request_goodput=(int(good.sum()) if goodput_config_dict else 0) / dur_s,
        output_throughput=total_output / dur_s, total_token_throughput=(total_input + total_output) / dur_s,
        latencies=stats)  # fmt: skip
    return metrics, actual_output_lens


def percentile_key(p: float) -> str:
    """ "99" for 99.0, "99.9" for 99.9: the name used in P99 and p99_ttft_ms."""
    return str(int(p)) if int(p) == p else str(p)


def print_and_collect_results(metrics: BenchmarkMetrics, benchmark_duration: float, outputs: list[RequestFuncOutput],
                              actual_output_lens: list[int], selected_percentile_metrics: list[str],
                              goodput_config_dict: dict[str, float]) -> dict[str, Any]:
    """Print vLLM's result table (the program's output, hence print) and return the result dictionary."""
    rows = [("Successful requests:", metrics.completed), ("Benchmark duration (s):", benchmark_duration),
            ("Total input tokens:", metrics.total_input), ("Total generated tokens:", metrics.total_output),
            ("Request throughput (req/s):", metrics.request_throughput)]
    rows += [("Request goodput (req/s):", metrics.request_goodput)] if goodput_config_dict else []
    rows += [("Output token throughput (tok/s):", metrics.output_throughput),
             ("Total Token throughput (tok/s):", metrics.total_token_throughput)]
    result: dict[str, Any] = {
        "duration": benchmark_duration, "completed": metrics.completed, "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output, "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if goodput_config_dict else None,
        "output_throughput": metrics.output_throughput, "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [o.prompt_len for o in outputs], "output_lens": actual_output_lens,
        "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
        "generated_texts": [o.generated_text for o in outputs], "errors": [o.error for o in outputs],
    }  # fmt: skip
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    for label, value in rows:
        print(f"{label:<40} {value:<10}" if isinstance(value, int) else f"{label:<40} {value:<10.2f}")
    for name, (short, header) in METRICS.items():
        if name not in selected_percentile_metrics:
            continue
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        for stat in ("mean", "median", "std"):
            result[f"{stat}_{name}_ms"] = getattr(metrics, f"{stat}_{name}_ms")
        rows = [(f"{stat.capitalize()} {short} (ms):", result[f"{stat}_{name}_ms"]) for stat in ("mean", "median")]
        for p, value in getattr(metrics, f"percentiles_{name}_ms"):
            result[f"p{percentile_key(p)}_{name}_ms"] = value
            rows.append((f"P{percentile_key(p)} {short} (ms):", value))
        for label, value in rows:
            print(f"{label:<40} {value:<10.2f}")
    print("=" * 50)
    return result



# the per-request lists are large and the metrics are records of their own: neither goes in extra_info
_PYTORCH_METRICS = [f"{s}_{name}_ms" for name in ("ttft", "tpot", "itl") for s in ("mean", "median", "std", "p99")]
_PER_REQUEST = ["ttfts", "itls", "generated_texts", "errors"]


def convert_to_pytorch_benchmark_format(args: argparse.Namespace, metrics: dict[str, list],
                                        extra_info: dict[str, Any]) -> list:
    """One record per metric in the PyTorch OSS benchmark database format
    (https://github.com/pytorch/pytorch/wiki/How-to-integrate-with-PyTorch-OSS-benchmark-database);
    empty unless SAVE_TO_PYTORCH_BENCHMARK_FORMAT is set, so ordinary runs write no extra file."""
    if not os.environ.get("SAVE_TO_PYTORCH_BENCHMARK_FORMAT"):
        return []
    # a copy of the arguments; tensor_parallel_size is kept when it was only given as --metadata
    run_args = {**vars(args)}
    if not run_args.get("tensor_parallel_size") and "tensor_parallel_size" in extra_info:
        run_args["tensor_parallel_size"] = extra_info["tensor_parallel_size"]
    return [{"benchmark": {"name": "atom benchmark", "extra_info": {"args": run_args}}, "model": {"name": args.model},
             "metric": {"name": name, "benchmark_values": values, "extra_info": extra_info}}
            for name, values in metrics.items()]


def save_to_pytorch_benchmark_format(args: argparse.Namespace, results: dict[str, Any], file_name: str) -> None:
    records = convert_to_pytorch_benchmark_format(
        args, {k: [results[k]] for k in _PYTORCH_METRICS if k in results},
        {k: v for k, v in results.items() if k not in _PYTORCH_METRICS and k not in _PER_REQUEST})
    if records:  # not a .json suffix, so that CI collecting *.json results skips it
        write_to_json(f"{os.path.splitext(file_name)[0]}.pytorch.json", records)


def _clear_inf(o: Any) -> Any:
    """JSON has no infinity: infinite floats (e.g. request_rate) are written as "inf"."""
    if isinstance(o, dict):
        return {k: _clear_inf(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_clear_inf(v) for v in o]
    return "inf" if isinstance(o, float) and math.isinf(o) else o


def write_to_json(filename: str, records: Any) -> None:
    with open(filename, "w", encoding="utf-8") as f:
        json.dump(_clear_inf(records), f)
