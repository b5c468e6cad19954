r"""Benchmark online serving throughput and latency (vLLM's ``benchmarks/benchmark_serving.py``). Start a
server (``python -m atom.entrypoints.openai_server``), then::

    python -m atom.benchmarks.benchmark_serving --dataset-name random --random-input-len 128 \
        --random-output-len 32 --num-prompts 50 --ignore-eos

Without ``--model`` the server is asked (``GET /v1/models``) which model it serves and the tokenizer is
loaded from the directory it reports. ``main(parse_args([...]))`` returns the dictionary ``--save-result``
writes. Every flag is described in docs/benchmark_serving.md.
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
from datetime import datetime
from typing import Any

import aiohttp
import numpy as np
from tqdm.asyncio import tqdm

from atom.benchmarks import backend_request_func as client
from atom.benchmarks.backend_request_func import BenchmarkError, RequestFuncInput
from atom.benchmarks.benchmark_utils import (
    GOODPUT_METRICS,
    PERCENTILE_METRICS,
    add_arguments,
    calculate_metrics,
    print_and_collect_results,
    write_to_json,
)
from atom.benchmarks.datasets import DATASET_NAMES, SampleRequest, get_samples

# importable from here as from vLLM's benchmark_serving module
__all__ = ["BenchmarkError", "calculate_metrics", "print_and_collect_results"]

logger = logging.getLogger(__name__)

# (flag, default or type, help[, more argparse keywords]) per argument group, in vLLM's names and order
ARGUMENTS: dict[str | None, list[tuple]] = {
    None: [
        ("--backend", "vllm", "Serving backend protocol.", dict(choices=list(client.BACKENDS))),
        ("--base-url", str, "Server base URL, instead of --host and --port."),
        ("--host", "127.0.0.1", "Server host (127.0.0.1 rather than localhost forces IPv4)."),
        ("--port", 8000, "Server port."),
        ("--endpoint", "/v1/completions", "API path appended to the base URL."),
        ("--dataset-name", "sharegpt", "Dataset to benchmark on.", dict(choices=DATASET_NAMES)),
        ("--dataset-path", str, "Local dataset file (or directory for hf)."),
        ("--max-concurrency", int, "Maximum number of requests in flight."),
        ("--model", str, "Model name (default: the one the server reports at /v1/models)."),
        ("--tokenizer", str, "Tokenizer name or path (default: the model's)."),
        ("--best-of", 1, "Generates best_of sequences per prompt."),
        ("--num-prompts", 1000, "Number of prompts to process."),
        ("--logprobs", int, "Number of logprobs per token to request (default: none)."),
        ("--request-rate", float("inf"), "Requests per second; inf sends every request at time 0."),
        ("--burstiness", 1.0, "Gamma shape of the gaps between requests: 1 is a Poisson process."),
        ("--seed", 0, "Seed of dataset sampling and arrival times."),
        ("--trust-remote-code", False, "Trust remote code from huggingface."),
        ("--disable-tqdm", False, "Hide the progress bar."),
        ("--profile", False, "POST /start_profile before and /stop_profile after the run."),
        ("--save-result", False, "Save the results to a JSON file."),
        ("--metadata", str, "KEY=VALUE pairs saved in the result JSON.", dict(metavar="KEY=VALUE", nargs="*")),
        ("--result-dir", str, "Directory for the result JSON (default: the current directory)."),
        ("--result-filename", str, "File name of the result JSON (default: from backend, rate, model, date)."),
        ("--ignore-eos", False, "Set ignore_eos in the requests (not supported by deepspeed-mii and tgi)."),
        ("--percentile-metrics", "ttft,tpot,itl", "Comma-separated metrics to report percentiles of."),
        ("--metric-percentiles", "99", 'Comma-separated percentiles, e.g. "25,50,75".'),
        ("--goodput", str, 'SLOs as "KEY:VALUE" pairs in ms, keys ttft, tpot and e2el.', dict(nargs="+")),
        ("--num-warmups", 0, "Warm-up requests before the measured run (not counted)."),
        ("--tokenizer-mode", "auto", "auto: the fast tokenizer if available.", dict(choices=["auto", "slow"])),
        ("--served-model-name", str, "The model name used in the API (default: --model)."),
        ("--lora-modules", str, "LoRA adapters; each request uses one at random.", dict(nargs="+")),
    ],
    "sonnet dataset options": [
        ("--sonnet-input-len", 550, "Input tokens per request."),
        ("--sonnet-output-len", 150, "Output tokens per request."),
        ("--sonnet-prefix-len", 200, "Prefix tokens per request."),
    ],
    "sharegpt dataset options": [("--sharegpt-output-len", int, "Output length, overriding the dataset's.")],
    "random dataset options": [
        ("--random-input-len", 1024, "Input tokens per request."),
        ("--random-output-len", 128, "Output tokens per request."),
        ("--random-range-ratio", 1.0, "Lengths are drawn uniformly from [length * ratio, length]."),
        ("--random-prefix-len", 0, "Prefix tokens shared by all requests, before the random ones."),
        ("--use-chat-template", False, "Format prompts with the chat template (counted in the input length)."),
    ],
    "hf dataset options": [
        ("--hf-subset", str, "Subset of the HF dataset (a sub-directory of --dataset-path)."),
        ("--hf-split", str, "Split of the HF dataset."),
        ("--hf-output-len", int, "Output length, overriding the dataset's."),
    ],
}


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0, rng=None) -> np.ndarray:
    """Send times in seconds after the start (the first at 0): gamma-distributed gaps of shape ``burstiness``
    (1: a Poisson process, below 1 burstier) and mean ``1 / request_rate``; all at 0 for an infinite rate."""
    if burstiness <= 0:
        raise ValueError(f"A positive burstiness factor is expected, but given {burstiness}.")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {request_rate}.")
    if request_rate == float("inf") or num_requests == 0:
        return np.zeros(num_requests)
    rng = rng if rng is not None else np.random.default_rng()
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


async def get_request(requests: list[SampleRequest], request_rate: float, burstiness: float = 1.0, rng=None):
    start = time.perf_counter()
    for request, send_at in zip(requests, arrival_times(len(requests), request_rate, burstiness, rng)):
        # sleep until an absolute time, so time spent between sleeps does not lower the achieved rate
        await asyncio.sleep(max(start + send_at - time.perf_counter(), 0))
        yield request


async def benchmark(args: argparse.Namespace, api_url: str, base_url: str, model_id: str, requests: list) -> tuple:
    """Send the test request, the warm-ups and then ``requests`` at their arrival times; returns the
    outputs of ``requests`` and the duration of their run."""
    lora_rng = random.Random(args.seed)  # with LoRA modules each request goes to an adapter chosen at random

    def make_input(request: SampleRequest, lora: list[str] | None = None) -> RequestFuncInput:
        model, name = (lora_rng.choice(lora),) * 2 if lora else (model_id, args.served_model_name)
        lens = dict(prompt_len=request.prompt_len, output_len=request.expected_output_len)
        options = dict(logprobs=args.logprobs, best_of=args.best_of, ignore_eos=args.ignore_eos)
        return RequestFuncInput(request.prompt, api_url, model=model, model_name=name, **lens, **options)

    async with client.client_session() as session:
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()

        async def send(request_input: RequestFuncInput, pbar: tqdm | None = None):
            async with semaphore:
                return await client.async_request(args.backend, request_input, session, pbar)

        async def profile(action: str) -> None:  # POST /start_profile or /stop_profile; a failure is not fatal
            try:
                async with session.post(f"{base_url}/{action}") as response:
                    level = logging.INFO if response.status == 200 else logging.WARNING
                    logger.log(level, "POST %s: HTTP %d %s", action, response.status, await response.text())
            except aiohttp.ClientError as exc:
                logger.warning("POST %s/%s failed: %s", base_url, action, exc)

        logger.info("Starting initial single prompt test run...")
        if not (test_output := await send(test_input := make_input(requests[0]))).success:
            raise BenchmarkError(
                f"Initial test run failed - please make sure the server is running at {base_url} and the benchmark "
                f"arguments (--backend, --endpoint, --model) are correctly specified. Error: {test_output.error}"
            )
        logger.info("Warming up with %d requests...", args.num_warmups)
        await asyncio.gather(*(send(test_input) for _ in range(args.num_warmups)))
        if args.profile:
            await profile("start_profile")
        traffic = "Poisson process" if args.burstiness == 1.0 else "gamma distribution"
        logger.info("Rate %s, burstiness %s (%s): starting the main run", args.request_rate, args.burstiness, traffic)
        pbar = None if args.disable_tqdm else tqdm(total=len(requests))
        start, tasks, rng = time.perf_counter(), [], np.random.default_rng(args.seed)
        async for request in get_request(requests, args.request_rate, args.burstiness, rng):
            tasks.append(asyncio.create_task(send(make_input(request, args.lora_modules), pbar)))
        outputs, duration = await asyncio.gather(*tasks), time.perf_counter() - start
        if pbar is not None:
            pbar.close()
        if args.profile:
            await profile("stop_profile")
    return outputs, duration


def check_goodput_args(args: argparse.Namespace) -> dict[str, float]:
    """--goodput "KEY:VALUE" pairs as {metric name: SLO in ms}."""
    try:
        goodput = {name: float(value) for name, value in (pair.split(":") for pair in args.goodput or [])}
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            'Specify service level objectives for goodput as "KEY:VALUE" pairs, where the key is a metric name '
            "and the value is a number in milliseconds."
        ) from err
    for name, value in goodput.items():
        if name not in GOODPUT_METRICS:
            raise ValueError(f"Invalid metric name found, {name}: {value}. It should be one of {GOODPUT_METRICS}.")
        if value < 0:
            raise ValueError(f"Invalid value found, {name}: {value}. The SLO should be non-negative.")
    return goodput


def _validate_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise ValueError("--num-prompts and --max-concurrency must be at least 1.")
    if unknown := [m for m in args.percentile_metrics.split(",") if m not in PERCENTILE_METRICS]:
        raise ValueError(f"Unknown --percentile-metrics {unknown}; allowed: {PERCENTILE_METRICS}.")
    if any(not 0 <= float(p) <= 100 for p in args.metric_percentiles.split(",")):
        raise ValueError(f"--metric-percentiles must be in [0, 100], got {args.metric_percentiles}.")
    if any("=" not in item for item in args.metadata or []):
        raise ValueError("Invalid metadata format. Please use KEY=VALUE format.")
    # every in-flight request holds a socket: at high concurrency a soft limit of 1024 files runs out
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < (target := hard if hard != resource.RLIM_INFINITY else 65535):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by ``args`` (see ``parse_args``) and return the result dictionary,
    also written to a JSON file with ``--save-result``. Raises ``BenchmarkError`` if it cannot run."""
    logger.info("Arguments: %s", args)
    _validate_args(args)
    base_url = args.base_url.rstrip("/") if args.base_url is not None else f"http://{args.host}:{args.port}"
    client.check_api_url(args.backend, api_url := f"{base_url}{args.endpoint}")
    goodput = check_goodput_args(args)
    model_id, root = (args.model, None) if args.model else client.served_model(base_url)
    tokenizer_id = args.tokenizer or (root if root and os.path.isdir(root) else model_id)
    tokenizer = client.get_tokenizer(tokenizer_id, args.tokenizer_mode, args.trust_remote_code)
    requests = get_samples(args, tokenizer)
    gc.collect()  # keep the garbage collector off the long-lived prompt data during the run
    gc.freeze()
    try:
        outputs, duration = asyncio.run(benchmark(args, api_url, base_url, model_id, requests))
    finally:
        gc.unfreeze()
    metrics = args.percentile_metrics.split(",")
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    stats, output_lens = calculate_metrics(requests, outputs, duration, tokenizer, metrics, percentiles, goodput)
    results = print_and_collect_results(stats, duration, outputs, output_lens, metrics, goodput)

    # setup, metadata and traffic first, then the measured results
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    result = dict(date=date, backend=args.backend, model_id=model_id, tokenizer_id=tokenizer_id, best_of=args.best_of)
    result["num_prompts"] = args.num_prompts
    result |= {k.strip(): v.strip() for k, v in (item.split("=", 1) for item in args.metadata or [])}
    rate = args.request_rate if args.request_rate < float("inf") else "inf"
    result |= dict(request_rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency, **results)
    if args.save_result:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        name = f"{args.backend}-{args.request_rate}qps{concurrency}-{model_id.split('/')[-1]}-{date}.json"
        file_name = os.path.join(args.result_dir or "", args.result_filename or name)
        os.makedirs(args.result_dir or ".", exist_ok=True)
        write_to_json(file_name, result)
        logger.info("Saved results to %s", file_name)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Benchmark the online serving throughput.")
    for group, rows in ARGUMENTS.items():
        add_arguments(parser.add_argument_group(group) if group else parser, rows)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse command line arguments (``sys.argv[1:]`` when ``argv`` is None)."""
    return build_parser().parse_args(argv)


def cli_main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        main(parse_args(argv))
    except (BenchmarkError, ValueError, OSError) as exc:  # one line saying what to change, not a traceback
        logger.error("%s", exc)
        sys.exit(1)


if __name__ == "__main__":
    cli_main()
