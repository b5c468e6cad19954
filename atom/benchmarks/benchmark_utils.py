"""Result files shared by the benchmarks (as in vLLM's ``benchmarks/benchmark_utils.py``)."""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

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
