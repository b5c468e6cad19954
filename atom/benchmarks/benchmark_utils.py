"""Result helpers shared by the benchmarks (as in vLLM's ``benchmarks/benchmark_utils.py``)."""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any


def convert_to_pytorch_benchmark_format(
    args: argparse.Namespace, metrics: dict[str, list], extra_info: dict[str, Any]
) -> list:
    """Convert results to the PyTorch OSS benchmark database format, one record per metric.

    https://github.com/pytorch/pytorch/wiki/How-to-integrate-with-PyTorch-OSS-benchmark-database

    Returns an empty list unless the environment variable
    SAVE_TO_PYTORCH_BENCHMARK_FORMAT is set, so that ordinary runs write no
    extra file.
    """
    records: list[dict[str, Any]] = []
    if not os.environ.get("SAVE_TO_PYTORCH_BENCHMARK_FORMAT", False):
        return records

    for name, benchmark_values in metrics.items():
        record = {
            "benchmark": {
                "name": "atom benchmark",
                # A copy: vars() is the namespace itself, which must not change.
                "extra_info": {"args": dict(vars(args))},
            },
            "model": {"name": args.model},
            "metric": {
                "name": name,
                "benchmark_values": benchmark_values,
                "extra_info": extra_info,
            },
        }
        # Keep tensor_parallel_size when it was only given as --metadata.
        tp = record["benchmark"]["extra_info"]["args"].get("tensor_parallel_size")
        if not tp and "tensor_parallel_size" in extra_info:
            record["benchmark"]["extra_info"]["args"]["tensor_parallel_size"] = extra_info[
                "tensor_parallel_size"
            ]
        records.append(record)
    return records


class InfEncoder(json.JSONEncoder):
    """JSON encoder that writes infinite floats (e.g. request_rate=inf) as the
    string "inf", since JSON has no infinity."""

    def clear_inf(self, o: Any) -> Any:
        if isinstance(o, dict):
            return {k: self.clear_inf(v) for k, v in o.items()}
        if isinstance(o, list):
            return [self.clear_inf(v) for v in o]
        if isinstance(o, float) and math.isinf(o):
            return "inf"
        return o

    def iterencode(self, o: Any, *args, **kwargs):
        return super().iterencode(self.clear_inf(o), *args, **kwargs)


def write_to_json(filename: str, records: Any) -> None:
    with open(filename, "w", encoding="utf-8") as f:
        json.dump(records, f, cls=InfEncoder)
