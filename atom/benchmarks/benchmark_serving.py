r"""Benchmark online serving throughput and latency.

Adapted from vLLM's ``benchmarks/benchmark_serving.py``.

On the server side, start an OpenAI-compatible server, e.g.::

    python -m atom.entrypoints.openai_server --model <your_model> --kv_cache_dtype fp8

On the client side, run::

    python -m atom.benchmarks.benchmark_serving \
        --backend vllm --model <your_model> --base-url http://localhost:8000 \
        --dataset-name random --random-input-len 1024 --random-output-len 128 \
        --num-prompts 1000 --request-rate inf --ignore-eos

For the tgi and tensorrt-llm backends add ``--endpoint /generate_stream``;
for openai-chat add ``--endpoint /v1/chat/completions``.

From Python, ``main(parse_args([...]))`` runs the same benchmark and returns
the result dictionary (the one ``--save-result`` writes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import random
import sys
import time
import warnings
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import aiohttp
import numpy as np
from tqdm.asyncio import tqdm
from transformers import PreTrainedTokenizerBase

from atom.benchmarks.backend_request_func import (
    AIOHTTP_TIMEOUT,
    ASYNC_REQUEST_FUNCS,
    RequestFuncInput,
    RequestFuncOutput,
    check_api_url,
    get_tokenizer,
)
from atom.benchmarks.benchmark_utils import convert_to_pytorch_benchmark_format, write_to_json
from atom.benchmarks.datasets import DATASET_NAMES, SampleRequest, get_samples

logger = logging.getLogger(__name__)

MILLISECONDS_TO_SECONDS_CONVERSION = 1000
PERCENTILE_METRICS = ["ttft", "tpot", "itl", "e2el"]
GOODPUT_METRICS = ["ttft", "tpot", "e2el"]


class BenchmarkError(RuntimeError):
    """The benchmark cannot run, e.g. the server is unreachable."""


@dataclass
class BenchmarkMetrics:
    completed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    percentiles_ttft_ms: list[tuple[float, float]]
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    percentiles_tpot_ms: list[tuple[float, float]]
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    percentiles_itl_ms: list[tuple[float, float]]
    # E2EL: end-to-end latency per request, from sending the request to
    # receiving the complete response, measured on the client.
    mean_e2el_ms: float
    median_e2el_ms: float
    std_e2el_ms: float
    percentiles_e2el_ms: list[tuple[float, float]]


# ---------------------------------------------------------------------------
# Request arrivals
# ---------------------------------------------------------------------------


def arrival_times(
    num_requests: int,
    request_rate: float,
    burstiness: float = 1.0,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Send time of each request in seconds after the start; the first is at 0.

    The gaps between requests follow a gamma distribution with shape
    ``burstiness`` and mean ``1 / request_rate``: burstiness 1 is a Poisson
    process (exponential gaps), below 1 the traffic is burstier, above 1 more
    uniform. With an infinite rate every request is sent at once.
    """
    if burstiness <= 0:
        raise ValueError(f"A positive burstiness factor is expected, but given {burstiness}.")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {request_rate}.")
    if request_rate == float("inf") or num_requests == 0:
        return np.zeros(num_requests)
    rng = rng if rng is not None else np.random.default_rng()
    # Scale theta keeps the mean gap at 1 / request_rate for any shape.
    theta = 1.0 / (request_rate * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=theta, size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


async def get_request(
    input_requests: list[SampleRequest],
    request_rate: float,
    burstiness: float = 1.0,
    rng: np.random.Generator | None = None,
) -> AsyncGenerator[SampleRequest, None]:
    """Yield the requests at their arrival times (see ``arrival_times``)."""
    times = arrival_times(len(input_requests), request_rate, burstiness, rng)
    start = time.perf_counter()
    for request, send_at in zip(input_requests, times):
        # Sleep until an absolute time rather than for each gap, so that the
        # time spent between sleeps does not lower the achieved rate.
        delay = start + send_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield request


# ---------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------


def calculate_metrics(
    input_requests: list[SampleRequest],
    outputs: list[RequestFuncOutput],
    dur_s: float,
    tokenizer: PreTrainedTokenizerBase,
    selected_percentile_metrics: list[str],
    selected_percentiles: list[float],
    goodput_config_dict: dict[str, float],
) -> tuple[BenchmarkMetrics, list[int]]:
    """Aggregate per-request outputs into benchmark metrics.

    Returns the metrics and the output length of every request (0 for failed
    ones). Latencies in ``outputs`` are in seconds; the metrics are in ms.
    """
    actual_output_lens: list[int] = []
    total_input = 0
    completed = 0
    good_completed = 0
    itls: list[float] = []
    tpots: list[float] = []
    all_tpots: list[float] = []
    ttfts: list[float] = []
    e2els: list[float] = []
    for request, output in zip(input_requests, outputs):
        if not output.success:
            actual_output_lens.append(0)
            continue
        output_len = output.output_tokens
        if not output_len:
            # The server reported no token count, so count the text's tokens.
            # len(output.itl) would undercount: a chunk may carry several tokens.
            output_len = len(tokenizer(output.generated_text, add_special_tokens=False).input_ids)
        actual_output_lens.append(output_len)
        total_input += request.prompt_len
        tpot = 0.0
        if output_len > 1:
            tpot = (output.latency - output.ttft) / (output_len - 1)
            tpots.append(tpot)
        # A request with at most one output token has no TPOT; it counts as 0
        # for goodput.
        all_tpots.append(tpot)
        itls += output.itl
        ttfts.append(output.ttft)
        e2els.append(output.latency)
        completed += 1

    if goodput_config_dict:
        per_request = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        names = [name for name in GOODPUT_METRICS if name in goodput_config_dict]
        slo_values = [goodput_config_dict[name] / MILLISECONDS_TO_SECONDS_CONVERSION for name in names]
        for req_metric in zip(*(per_request[name] for name in names)):
            if all(slo >= value for slo, value in zip(slo_values, req_metric)):
                good_completed += 1

    if completed == 0:
        warnings.warn(
            "All requests failed. This is likely due to a misconfiguration on the benchmark arguments.",
            stacklevel=2,
        )

    def stats(values: list[float]) -> tuple[float, float, float, list[tuple[float, float]]]:
        # An empty list (e.g. no ITLs from a non-streaming backend) reports 0.
        data = values or [0.0]
        return (
            float(np.mean(data)) * 1000,
            float(np.median(data)) * 1000,
            float(np.std(data)) * 1000,
            [(p, float(np.percentile(data, p)) * 1000) for p in selected_percentiles],
        )

    mean_ttft, median_ttft, std_ttft, p_ttft = stats(ttfts)
    mean_tpot, median_tpot, std_tpot, p_tpot = stats(tpots)
    mean_itl, median_itl, std_itl, p_itl = stats(itls)
    mean_e2el, median_e2el, std_e2el, p_e2el = stats(e2els)
    total_output = sum(actual_output_lens)
    metrics = BenchmarkMetrics(
        completed=completed,
        total_input=total_input,
        total_output=total_output,
        request_throughput=completed / dur_s,
        request_goodput=good_completed / dur_s,
        output_throughput=total_output / dur_s,
        total_token_throughput=(total_input + total_output) / dur_s,
        mean_ttft_ms=mean_ttft,
        median_ttft_ms=median_ttft,
        std_ttft_ms=std_ttft,
        percentiles_ttft_ms=p_ttft,
        mean_tpot_ms=mean_tpot,
        median_tpot_ms=median_tpot,
        std_tpot_ms=std_tpot,
        percentiles_tpot_ms=p_tpot,
        mean_itl_ms=mean_itl,
        median_itl_ms=median_itl,
        std_itl_ms=std_itl,
        percentiles_itl_ms=p_itl,
        mean_e2el_ms=mean_e2el,
        median_e2el_ms=median_e2el,
        std_e2el_ms=std_e2el,
        percentiles_e2el_ms=p_e2el,
    )
    return metrics, actual_output_lens


def percentile_key(p: float) -> str:
    """ "99" for 99.0, "99.9" for 99.9: the name used in P99 and p99_ttft_ms."""
    return str(int(p)) if int(p) == p else str(p)


def print_and_collect_results(
    metrics: BenchmarkMetrics,
    benchmark_duration: float,
    outputs: list[RequestFuncOutput],
    actual_output_lens: list[int],
    selected_percentile_metrics: list[str],
    goodput_config_dict: dict[str, float],
) -> dict[str, Any]:
    """Print vLLM's result table and return the result dictionary."""
    # The table is the program's output, hence print rather than logging.
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print("{:<40} {:<10}".format("Successful requests:", metrics.completed))
    print("{:<40} {:<10.2f}".format("Benchmark duration (s):", benchmark_duration))
    print("{:<40} {:<10}".format("Total input tokens:", metrics.total_input))
    print("{:<40} {:<10}".format("Total generated tokens:", metrics.total_output))
    print("{:<40} {:<10.2f}".format("Request throughput (req/s):", metrics.request_throughput))
    if goodput_config_dict:
        print("{:<40} {:<10.2f}".format("Request goodput (req/s):", metrics.request_goodput))
    print("{:<40} {:<10.2f}".format("Output token throughput (tok/s):", metrics.output_throughput))
    print("{:<40} {:<10.2f}".format("Total Token throughput (tok/s):", metrics.total_token_throughput))

    result: dict[str, Any] = {
        "duration": benchmark_duration,
        "completed": metrics.completed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if goodput_config_dict else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [output.prompt_len for output in outputs],
        "output_lens": actual_output_lens,
        "ttfts": [output.ttft for output in outputs],
        "itls": [output.itl for output in outputs],
        "generated_texts": [output.generated_text for output in outputs],
        "errors": [output.error for output in outputs],
    }

    def process_one_metric(metric_attribute_name: str, metric_name: str, metric_header: str) -> None:
        # e.g. ("ttft", "TTFT", "Time to First Token")
        if metric_attribute_name not in selected_percentile_metrics:
            return
        mean = getattr(metrics, f"mean_{metric_attribute_name}_ms")
        median = getattr(metrics, f"median_{metric_attribute_name}_ms")
        print("{s:{c}^{n}}".format(s=metric_header, n=50, c="-"))
        print("{:<40} {:<10.2f}".format(f"Mean {metric_name} (ms):", mean))
        print("{:<40} {:<10.2f}".format(f"Median {metric_name} (ms):", median))
        result[f"mean_{metric_attribute_name}_ms"] = mean
        result[f"median_{metric_attribute_name}_ms"] = median
        result[f"std_{metric_attribute_name}_ms"] = getattr(metrics, f"std_{metric_attribute_name}_ms")
        for p, value in getattr(metrics, f"percentiles_{metric_attribute_name}_ms"):
            p_word = percentile_key(p)
            print("{:<40} {:<10.2f}".format(f"P{p_word} {metric_name} (ms):", value))
            result[f"p{p_word}_{metric_attribute_name}_ms"] = value

    process_one_metric("ttft", "TTFT", "Time to First Token")
    process_one_metric("tpot", "TPOT", "Time per Output Token (excl. 1st token)")
    process_one_metric("itl", "ITL", "Inter-token Latency")
    process_one_metric("e2el", "E2EL", "End-to-end Latency")
    print("=" * 50)
    return result


# ---------------------------------------------------------------------------
# The benchmark run
# ---------------------------------------------------------------------------


async def _post_profile(session: aiohttp.ClientSession, base_url: str, action: str) -> None:
    """POST /start_profile or /stop_profile; a failure is reported, not fatal."""
    url = f"{base_url}/{action}"
    try:
        async with session.post(url) as response:
            if response.status == 200:
                logger.info("POST %s succeeded", url)
            else:
                logger.warning("POST %s failed: HTTP %d %s", url, response.status, await response.text())
    except aiohttp.ClientError as exc:
        logger.warning("POST %s failed: %s", url, exc)


async def benchmark(
    backend: str,
    api_url: str,
    base_url: str,
    model_id: str,
    model_name: str | None,
    tokenizer: PreTrainedTokenizerBase,
    input_requests: list[SampleRequest],
    logprobs: int | None,
    request_rate: float,
    burstiness: float,
    disable_tqdm: bool,
    profile: bool,
    selected_percentile_metrics: list[str],
    selected_percentiles: list[float],
    ignore_eos: bool,
    goodput_config_dict: dict[str, float],
    max_concurrency: int | None,
    lora_modules: list[str] | None = None,
    best_of: int = 1,
    num_warmups: int = 0,
    seed: int = 0,
) -> dict[str, Any]:
    if backend not in ASYNC_REQUEST_FUNCS:
        raise ValueError(f"Unknown backend: {backend}")
    request_func = ASYNC_REQUEST_FUNCS[backend]
    rng = np.random.default_rng(seed)

    def make_input(request: SampleRequest, model: str = model_id, name: str | None = model_name):
        return RequestFuncInput(
            model=model,
            model_name=name,
            prompt=request.prompt,
            api_url=api_url,
            prompt_len=request.prompt_len,
            output_len=request.expected_output_len,
            logprobs=logprobs,
            best_of=best_of,
            ignore_eos=ignore_eos,
        )

    # aiohttp allows 100 connections per session by default, which would
    # silently cap the concurrency; --max-concurrency is enforced below instead.
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, trust_env=True, timeout=AIOHTTP_TIMEOUT) as session:
        logger.info("Starting initial single prompt test run...")
        test_input = make_input(input_requests[0])
        test_output = await request_func(request_func_input=test_input, session=session)
        if not test_output.success:
            raise BenchmarkError(
                f"Initial test run failed - please make sure the server is running at {base_url} "
                f"and the benchmark arguments (--backend, --endpoint, --model) are correctly "
                f"specified. Error: {test_output.error}"
            )
        logger.info("Initial test run completed.")

        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

        async def limited_request_func(request_func_input: RequestFuncInput, pbar: tqdm | None):
            async with semaphore:
                return await request_func(request_func_input=request_func_input, pbar=pbar, session=session)

        if num_warmups > 0:
            logger.info("Warming up with %d requests...", num_warmups)
            await asyncio.gather(*(limited_request_func(test_input, None) for _ in range(num_warmups)))
            logger.info("Warmup completed.")

        if profile:
            logger.info("Starting profiler...")
            await _post_profile(session, base_url, "start_profile")

        distribution = "Poisson process" if burstiness == 1.0 else "Gamma distribution"
        logger.info("Traffic request rate: %s", request_rate)
        logger.info("Burstiness factor: %s (%s)", burstiness, distribution)
        logger.info("Maximum request concurrency: %s", max_concurrency)
        logger.info("Starting main benchmark run...")

        pbar = None if disable_tqdm else tqdm(total=len(input_requests))
        lora_rng = random.Random(seed)
        benchmark_start_time = time.perf_counter()
        tasks: list[asyncio.Task] = []
        async for request in get_request(input_requests, request_rate, burstiness, rng):
            if lora_modules:
                # Each request goes to a LoRA adapter chosen at random.
                lora = lora_rng.choice(lora_modules)
                request_func_input = make_input(request, model=lora, name=lora)
            else:
                request_func_input = make_input(request)
            tasks.append(asyncio.create_task(limited_request_func(request_func_input, pbar)))
        outputs: list[RequestFuncOutput] = await asyncio.gather(*tasks)
        benchmark_duration = time.perf_counter() - benchmark_start_time
        if pbar is not None:
            pbar.close()

        if profile:
            logger.info("Stopping profiler...")
            await _post_profile(session, base_url, "stop_profile")

    metrics, actual_output_lens = calculate_metrics(
        input_requests=input_requests,
        outputs=outputs,
        dur_s=benchmark_duration,
        tokenizer=tokenizer,
        selected_percentile_metrics=selected_percentile_metrics,
        selected_percentiles=selected_percentiles,
        goodput_config_dict=goodput_config_dict,
    )
    return print_and_collect_results(
        metrics,
        benchmark_duration,
        outputs,
        actual_output_lens,
        selected_percentile_metrics,
        goodput_config_dict,
    )


# ---------------------------------------------------------------------------
# Arguments and results
# ---------------------------------------------------------------------------


def parse_goodput(slo_pairs: list[str]) -> dict[str, float]:
    goodput_config_dict = {}
    try:
        for slo_pair in slo_pairs:
            slo_name, slo_val = slo_pair.split(":")
            goodput_config_dict[slo_name] = float(slo_val)
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            "Invalid format found for service level objectives. "
            'Specify service level objectives for goodput as "KEY:VALUE" '
            "pairs, where the key is a metric name, and the value is a "
            "number in milliseconds."
        ) from err
    return goodput_config_dict


def check_goodput_args(args: argparse.Namespace) -> dict[str, float]:
    """Parse and validate --goodput into {metric name: SLO in ms}."""
    goodput_config_dict: dict[str, float] = {}
    if args.goodput:
        goodput_config_dict = parse_goodput(args.goodput)
        for slo_name, slo_val in goodput_config_dict.items():
            if slo_name not in GOODPUT_METRICS:
                raise ValueError(
                    f"Invalid metric name found, {slo_name}: {slo_val}. "
                    f"The service level objective name should be one of {GOODPUT_METRICS}."
                )
            if slo_val < 0:
                raise ValueError(
                    f"Invalid value found, {slo_name}: {slo_val}. "
                    "The service level objective value should be non-negative."
                )
    return goodput_config_dict


def save_to_pytorch_benchmark_format(
    args: argparse.Namespace, results: dict[str, Any], file_name: str
) -> None:
    metrics = [
        "median_ttft_ms", "mean_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms",
        "median_itl_ms", "mean_itl_ms", "std_itl_ms", "p99_itl_ms",
    ]  # fmt: skip
    # The per-request lists are large; leave them out of the records.
    ignored_metrics = ["ttfts", "itls", "generated_texts", "errors"]
    pt_records = convert_to_pytorch_benchmark_format(
        args=args,
        metrics={k: [results[k]] for k in metrics if k in results},
        extra_info={k: results[k] for k in results if k not in metrics and k not in ignored_metrics},
    )
    if pt_records:
        # Not a .json suffix, so that CI collecting *.json results skips it.
        pt_file = f"{os.path.splitext(file_name)[0]}.pytorch.json"
        write_to_json(pt_file, pt_records)


def _raise_open_file_limit() -> None:
    # Every in-flight request holds a socket. At high concurrency the common
    # soft limit of 1024 open files is exhausted and requests fail client-side.
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = hard if hard != resource.RLIM_INFINITY else 65535
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError) as exc:
        logger.debug("Could not raise the open file limit: %s", exc)


def _validate_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}.")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}.")
    unknown = [m for m in args.percentile_metrics.split(",") if m not in PERCENTILE_METRICS]
    if unknown:
        raise ValueError(f"Unknown --percentile-metrics {unknown}; allowed: {PERCENTILE_METRICS}.")
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    if any(not 0 <= p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles must be in [0, 100], got {args.metric_percentiles}.")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by ``args`` (see ``parse_args``).

    Returns the result dictionary, also written to a JSON file with
    ``--save-result``. Raises ``BenchmarkError`` if the server cannot be used.
    """
    logger.info("Arguments: %s", args)
    _validate_args(args)
    _raise_open_file_limit()

    backend = args.backend
    model_id = args.model
    model_name = args.served_model_name
    tokenizer_id = args.tokenizer if args.tokenizer is not None else args.model

    if args.base_url is not None:
        base_url = args.base_url.rstrip("/")
    else:
        base_url = f"http://{args.host}:{args.port}"
    api_url = f"{base_url}{args.endpoint}"
    check_api_url(backend, api_url)

    tokenizer = get_tokenizer(
        tokenizer_id, tokenizer_mode=args.tokenizer_mode, trust_remote_code=args.trust_remote_code
    )
    input_requests = get_samples(args, tokenizer)
    goodput_config_dict = check_goodput_args(args)

    # Keep the garbage collector away from the long-lived prompt data to avoid
    # pauses during the run; unfrozen afterwards for callers that continue.
    gc.collect()
    gc.freeze()
    try:
        benchmark_result = asyncio.run(
            benchmark(
                backend=backend,
                api_url=api_url,
                base_url=base_url,
                model_id=model_id,
                model_name=model_name,
                tokenizer=tokenizer,
                input_requests=input_requests,
                logprobs=args.logprobs,
                request_rate=args.request_rate,
                burstiness=args.burstiness,
                disable_tqdm=args.disable_tqdm,
                profile=args.profile,
                selected_percentile_metrics=args.percentile_metrics.split(","),
                selected_percentiles=[float(p) for p in args.metric_percentiles.split(",")],
                ignore_eos=args.ignore_eos,
                goodput_config_dict=goodput_config_dict,
                max_concurrency=args.max_concurrency,
                lora_modules=args.lora_modules,
                best_of=args.best_of,
                num_warmups=args.num_warmups,
                seed=args.seed,
            )
        )
    finally:
        gc.unfreeze()

    # Setup, metadata and traffic first, then the measured results.
    current_dt = datetime.now().strftime("%Y%m%d-%H%M%S")
    result_json: dict[str, Any] = {
        "date": current_dt,
        "backend": backend,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "best_of": args.best_of,
        "num_prompts": args.num_prompts,
    }
    for item in args.metadata or []:
        if "=" not in item:
            raise ValueError("Invalid metadata format. Please use KEY=VALUE format.")
        key, value = item.split("=", 1)
        result_json[key.strip()] = value.strip()
    result_json["request_rate"] = args.request_rate if args.request_rate < float("inf") else "inf"
    result_json["burstiness"] = args.burstiness
    result_json["max_concurrency"] = args.max_concurrency
    result_json = {**result_json, **benchmark_result}

    if args.save_result:
        base_model_id = model_id.split("/")[-1]
        max_concurrency_str = (
            f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        )
        file_name = f"{backend}-{args.request_rate}qps{max_concurrency_str}-{base_model_id}-{current_dt}.json"
        if args.result_filename:
            file_name = args.result_filename
        if args.result_dir:
            os.makedirs(args.result_dir, exist_ok=True)
            file_name = os.path.join(args.result_dir, file_name)
        write_to_json(file_name, result_json)
        logger.info("Saved results to %s", file_name)
        save_to_pytorch_benchmark_format(args, result_json, file_name)
    return result_json


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Benchmark the online serving throughput.")
    parser.add_argument(
        "--backend",
        type=str,
        default="vllm",
        choices=list(ASYNC_REQUEST_FUNCS.keys()),
        help="Serving backend protocol to use.",
    )
    parser.add_argument(
        "--base-url",
        type=str,
        default=None,
        help="Server or API base url if not using http host and port.",
    )
    # 127.0.0.1 rather than localhost forces IPv4.
    parser.add_argument("--host", type=str, default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", type=str, default="/v1/completions", help="API endpoint.")
    parser.add_argument(
        "--dataset-name",
        type=str,
        default="sharegpt",
        choices=DATASET_NAMES,
        help="Name of the dataset to benchmark on.",
    )
    parser.add_argument(
        "--dataset-path",
        type=str,
        default=None,
        help="Path to the sharegpt/sonnet/burstgpt dataset file, or to a local "
        "Hugging Face dataset (directory or file) for --dataset-name hf.",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="Maximum number of concurrent requests. This can be used "
        "to help simulate an environment where a higher level component "
        "is enforcing a maximum number of concurrent requests. While the "
        "--request-rate argument controls the rate at which requests are "
        "initiated, this argument will control how many are actually allowed "
        "to execute at a time. This means that when used in combination, the "
        "actual request rate may be lower than specified with --request-rate, "
        "if the server is not processing requests fast enough to keep up.",
    )
    parser.add_argument("--model", type=str, required=True, help="Name of the model.")
    parser.add_argument(
        "--tokenizer",
        type=str,
        default=None,
        help="Name or path of the tokenizer, if not using the default tokenizer (--model).",
    )
    parser.add_argument(
        "--best-of",
        type=int,
        default=1,
        help="Generates `best_of` sequences per prompt and returns the best one.",
    )
    parser.add_argument("--num-prompts", type=int, default=1000, help="Number of prompts to process.")
    parser.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="Number of logprobs-per-token to compute & return as part of the request. "
        "If unspecified, no logprobs are requested.",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Number of requests per second. If this is inf, "
        "then all the requests are sent at time 0. "
        "Otherwise, we use Poisson process or gamma distribution "
        "to synthesize the request arrival times.",
    )
    parser.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Burstiness factor of the request generation. "
        "Only take effect when request_rate is not inf. "
        "Default value is 1, which follows Poisson process. "
        "Otherwise, the request intervals follow a gamma distribution. "
        "A lower burstiness value (0 < burstiness < 1) results in more "
        "bursty requests. A higher burstiness value (burstiness > 1) "
        "results in a more uniform arrival of requests.",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trust-remote-code", action="store_true", help="Trust remote code from huggingface")
    parser.add_argument("--disable-tqdm", action="store_true", help="Specify to disable tqdm progress bar.")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="Use Torch Profiler: POST /start_profile before and /stop_profile after the run. "
        "The server must be started with --torch-profiler-dir or ATOM_TORCH_PROFILER_DIR.",
    )
    parser.add_argument(
        "--save-result", action="store_true", help="Specify to save benchmark results to a json file"
    )
    parser.add_argument(
        "--metadata",
        metavar="KEY=VALUE",
        nargs="*",
        help="Key-value pairs (e.g, --metadata version=0.3.3 tp=1) "
        "for metadata of this run to be saved in the result JSON file "
        "for record keeping purposes.",
    )
    parser.add_argument(
        "--result-dir",
        type=str,
        default=None,
        help="Specify directory to save benchmark json results. "
        "If not specified, results are saved in the current directory.",
    )
    parser.add_argument(
        "--result-filename",
        type=str,
        default=None,
        help="Specify the filename to save benchmark json results. "
        "If not specified, results will be saved in "
        "{backend}-{args.request_rate}qps-{base_model_id}-{current_dt}.json format.",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="Set ignore_eos flag when sending the benchmark request. "
        "Warning: ignore_eos is not supported in deepspeed_mii and tgi.",
    )
    parser.add_argument(
        "--percentile-metrics",
        type=str,
        default="ttft,tpot,itl",
        help="Comma-separated list of selected metrics to report percentiles. "
        "This argument specifies the metrics to report percentiles. "
        'Allowed metric names are "ttft", "tpot", "itl", "e2el". '
        'Default value is "ttft,tpot,itl".',
    )
    parser.add_argument(
        "--metric-percentiles",
        type=str,
        default="99",
        help="Comma-separated list of percentiles for selected metrics. "
        'To report 25-th, 50-th, and 75-th percentiles, use "25,50,75". '
        'Default value is "99". '
        'Use "--percentile-metrics" to select metrics.',
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        required=False,
        help='Specify service level objectives for goodput as "KEY:VALUE" '
        "pairs, where the key is a metric name, and the value is in "
        'milliseconds. Multiple "KEY:VALUE" pairs can be provided, '
        "separated by spaces. Allowed request level metric names are "
        '"ttft", "tpot", "e2el". For more context on the definition of '
        "goodput, refer to DistServe paper: https://arxiv.org/pdf/2401.09670 "
        "and the blog: https://hao-ai-lab.github.io/blogs/distserve",
    )
    parser.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="Number of warm-up requests sent after the initial test request and before the "
        "measured run (not counted in the results).",
    )

    sonnet_group = parser.add_argument_group("sonnet dataset options")
    sonnet_group.add_argument(
        "--sonnet-input-len",
        type=int,
        default=550,
        help="Number of input tokens per request, used only for sonnet dataset.",
    )
    sonnet_group.add_argument(
        "--sonnet-output-len",
        type=int,
        default=150,
        help="Number of output tokens per request, used only for sonnet dataset.",
    )
    sonnet_group.add_argument(
        "--sonnet-prefix-len",
        type=int,
        default=200,
        help="Number of prefix tokens per request, used only for sonnet dataset.",
    )

    sharegpt_group = parser.add_argument_group("sharegpt dataset options")
    sharegpt_group.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="Output length for each request. Overrides the output length from the ShareGPT dataset.",
    )

    random_group = parser.add_argument_group("random dataset options")
    random_group.add_argument(
        "--random-input-len",
        type=int,
        default=1024,
        help="Number of input tokens per request, used only for random sampling.",
    )
    random_group.add_argument(
        "--random-output-len",
        type=int,
        default=128,
        help="Number of output tokens per request, used only for random sampling.",
    )
    random_group.add_argument(
        "--random-range-ratio",
        type=float,
        default=1.0,
        help="Range of sampled ratio of input/output length, used only for random sampling: "
        "lengths are drawn uniformly from [length * ratio, length], so 1.0 gives fixed lengths.",
    )
    random_group.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="Number of fixed prefix tokens before the random context, shared by all requests. "
        "The total input length is random-prefix-len plus a random context length drawn from "
        "[random-input-len * random-range-ratio, random-input-len].",
    )
    random_group.add_argument(
        "--use-chat-template",
        action="store_true",
        help="Use chat template to format the prompt (the template's tokens count towards "
        "--random-input-len).",
    )

    hf_group = parser.add_argument_group("hf dataset options")
    hf_group.add_argument(
        "--hf-subset",
        type=str,
        default=None,
        help="Subset of the HF dataset (a sub-directory of --dataset-path).",
    )
    hf_group.add_argument("--hf-split", type=str, default=None, help="Split of the HF dataset.")
    hf_group.add_argument(
        "--hf-output-len",
        type=int,
        default=None,
        help="Output length for each request. Overrides the output lengths from the sampled HF dataset.",
    )

    parser.add_argument(
        "--tokenizer-mode",
        type=str,
        default="auto",
        choices=["auto", "slow"],
        help='The tokenizer mode. "auto" will use the fast tokenizer if available; '
        '"slow" will always use the slow tokenizer.',
    )
    parser.add_argument(
        "--served-model-name",
        type=str,
        default=None,
        help="The model name used in the API. If not specified, the model name will be "
        "the same as the --model argument.",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        help="A subset of LoRA module names passed in when launching the server. "
        "For each request, the script chooses a LoRA module at random.",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse command line arguments (``sys.argv[1:]`` when ``argv`` is None)."""
    return build_parser().parse_args(argv)


def cli_main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        main(args)
    except BenchmarkError as exc:
        logger.error("%s", exc)
        sys.exit(1)


if __name__ == "__main__":
    cli_main()
