r"""Benchmark online serving throughput and latency (vLLM's ``benchmarks/benchmark_serving.py``).

Start a server (``python -m atom.entrypoints.openai_server``), then::

    python -m atom.benchmarks.benchmark_serving --dataset-name random --random-input-len 128 \
        --random-output-len 32 --num-prompts 50 --ignore-eos

Without ``--model`` the benchmark asks the server (``GET /v1/models``) which model it serves and
loads that model's tokenizer from the directory the server reports. ``main(parse_args([...]))``
runs the same benchmark from Python and returns the result dictionary ``--save-result`` writes.
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
from collections.abc import AsyncGenerator
from datetime import datetime
from typing import Any

import aiohttp
import numpy as np
from tqdm.asyncio import tqdm
from transformers import PreTrainedTokenizerBase

from atom.benchmarks.backend_request_func import (
    AIOHTTP_TIMEOUT,
    BACKENDS,
    BenchmarkError,
    RequestFuncInput,
    RequestFuncOutput,
    async_request,
    check_api_url,
    get_tokenizer,
    served_model,
)
from atom.benchmarks.benchmark_utils import (
    GOODPUT_METRICS,
    PERCENTILE_METRICS,
    BenchmarkMetrics,
    calculate_metrics,
    percentile_key,
    print_and_collect_results,
    save_to_pytorch_benchmark_format,
    write_to_json,
)
from atom.benchmarks.datasets import DATASET_NAMES, SampleRequest, get_samples

# importable from here as from vLLM's benchmark_serving module
__all__ = ["BenchmarkError", "BenchmarkMetrics", "calculate_metrics", "percentile_key", "print_and_collect_results"]

logger = logging.getLogger(__name__)

def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0,
                  rng: np.random.Generator | None = None) -> np.ndarray:
    """Send time of each request in seconds after the start (the first at 0). The gaps follow a gamma
    distribution of shape ``burstiness`` and mean ``1 / request_rate``: 1 is a Poisson process, below
    1 burstier, above 1 more uniform. With an infinite rate every request is sent at once."""
    if burstiness <= 0:
        raise ValueError(f"A positive burstiness factor is expected, but given {burstiness}.")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {request_rate}.")
    if request_rate == float("inf") or num_requests == 0:
        return np.zeros(num_requests)
    rng = rng if rng is not None else np.random.default_rng()
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


async def get_request(input_requests: list[SampleRequest], request_rate: float, burstiness: float = 1.0,
                      rng: np.random.Generator | None = None) -> AsyncGenerator[SampleRequest, None]:
    """Yield the requests at their arrival times (see ``arrival_times``)."""
    start = time.perf_counter()
    for request, send_at in zip(input_requests, arrival_times(len(input_requests), request_rate, burstiness, rng)):
        # sleep until an absolute time, so time spent between sleeps does not lower the achieved rate
        await asyncio.sleep(max(start + send_at - time.perf_counter(), 0))
        yield request


async def _post_profile(session: aiohttp.ClientSession, base_url: str, action: str) -> None:
    """POST /start_profile or /stop_profile; a failure is reported, not fatal."""
    try:
        async with session.post(f"{base_url}/{action}") as response:
            logger.log(logging.INFO if response.status == 200 else logging.WARNING, "POST %s/%s: HTTP %d %s",
                       base_url, action, response.status, await response.text())
    except aiohttp.ClientError as exc:
        logger.warning("POST %s/%s failed: %s", base_url, action, exc)


async def benchmark(args: argparse.Namespace, api_url: str, base_url: str, model_id: str,
                    tokenizer: PreTrainedTokenizerBase, input_requests: list[SampleRequest],
                    goodput_config_dict: dict[str, float]) -> dict[str, Any]:
    def make_input(request: SampleRequest, model: str = model_id, name: str | None = args.served_model_name):
        return RequestFuncInput(model=model, model_name=name, prompt=request.prompt, api_url=api_url,
                                prompt_len=request.prompt_len, output_len=request.expected_output_len,
                                logprobs=args.logprobs, best_of=args.best_of, ignore_eos=args.ignore_eos)

    # aiohttp's default of 100 connections would silently cap the concurrency; --max-concurrency rules
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, trust_env=True, timeout=AIOHTTP_TIMEOUT) as session:
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()

        async def send(request_input: RequestFuncInput, pbar: tqdm | None = None) -> RequestFuncOutput:
            async with semaphore:
                return await async_request(args.backend, request_input, session, pbar)

        logger.info("Starting initial single prompt test run...")
        test_input = make_input(input_requests[0])
        if not (test_output := await send(test_input)).success:
            raise BenchmarkError(f"Initial test run failed - please make sure the server is running at {base_url} "
                                 "and the benchmark arguments (--backend, --endpoint, --model) are correctly "
                                 f"specified. Error: {test_output.error}")
        if args.num_warmups > 0:
            logger.info("Warming up with %d requests...", args.num_warmups)
            await asyncio.gather(*(send(test_input) for _ in range(args.num_warmups)))
        if args.profile:
            await _post_profile(session, base_url, "start_profile")
        logger.info("Request rate %s, burstiness %s (%s), max concurrency %s: starting the main run", args.request_rate,
                    args.burstiness, "Poisson process" if args.burstiness == 1.0 else "gamma distribution",
                    args.max_concurrency)
        pbar = None if args.disable_tqdm else tqdm(total=len(input_requests))
        lora_rng = random.Random(args.seed)
        start, tasks = time.perf_counter(), []
        async for request in get_request(input_requests, args.request_rate, args.burstiness,
                                         np.random.default_rng(args.seed)):
            # with LoRA modules each request goes to an adapter chosen at random
            lora = lora_rng.choice(args.lora_modules) if args.lora_modules else None
            request_input = make_input(request, lora, lora) if lora else make_input(request)
            tasks.append(asyncio.create_task(send(request_input, pbar)))
        outputs: list[RequestFuncOutput] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if pbar is not None:
            pbar.close()
        if args.profile:
            await _post_profile(session, base_url, "stop_profile")
    percentile_metrics = args.percentile_metrics.split(",")
    metrics, output_lens = calculate_metrics(input_requests, outputs, duration, tokenizer, percentile_metrics,
                                             [float(p) for p in args.metric_percentiles.split(",")],
                                             goodput_config_dict)
    return print_and_collect_results(metrics, duration, outputs, output_lens, percentile_metrics,
                                     goodput_config_dict)


def check_goodput_args(args: argparse.Namespace) -> dict[str, float]:
    """Parse and validate --goodput "KEY:VALUE" pairs into {metric name: SLO in ms}."""
    goodput: dict[str, float] = {}
    for pair in args.goodput or []:
        try:
            name, value = pair.split(":")
            goodput[name] = float(value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(
                'Invalid format found for service level objectives. Specify service level objectives for goodput '
                'as "KEY:VALUE" pairs, where the key is a metric name, and the value is a number in milliseconds.'
            ) from err
        if name not in GOODPUT_METRICS:
            raise ValueError(f"Invalid metric name found, {name}: {value}. The service level objective name should "
                             f"be one of {GOODPUT_METRICS}.")
        if goodput[name] < 0:
            raise ValueError(f"Invalid value found, {name}: {value}. The service level objective value should be "
                             "non-negative.")
    return goodput


def _validate_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}.")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}.")
    if unknown := [m for m in args.percentile_metrics.split(",") if m not in PERCENTILE_METRICS]:
        raise ValueError(f"Unknown --percentile-metrics {unknown}; allowed: {PERCENTILE_METRICS}.")
    if any(not 0 <= float(p) <= 100 for p in args.metric_percentiles.split(",")):
        raise ValueError(f"--metric-percentiles must be in [0, 100], got {args.metric_percentiles}.")
    if any("=" not in item for item in args.metadata or []):
        raise ValueError("Invalid metadata format. Please use KEY=VALUE format.")


def _raise_open_file_limit() -> None:
    # every in-flight request holds a socket: at high concurrency a soft limit of 1024 files runs out
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = hard if hard != resource.RLIM_INFINITY else 65535
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError) as exc:
        logger.debug("Could not raise the open file limit: %s", exc)


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by ``args`` (see ``parse_args``) and return the result dictionary,
    also written to a JSON file with ``--save-result``. Raises ``BenchmarkError`` if it cannot run."""
    logger.info("Arguments: %s", args)
    _validate_args(args)
    _raise_open_file_limit()
    base_url = args.base_url.rstrip("/") if args.base_url is not None else f"http://{args.host}:{args.port}"
    api_url = f"{base_url}{args.endpoint}"
    check_api_url(args.backend, api_url)
    goodput_config_dict = check_goodput_args(args)
    model_id, root = args.model, None
    if model_id is None:
        model_id, root = served_model(base_url)
        logger.info("Benchmarking the served model %s", model_id)
    tokenizer_id = args.tokenizer or (root if root and os.path.isdir(root) else model_id)
    tokenizer = get_tokenizer(tokenizer_id, args.tokenizer_mode, args.trust_remote_code)
    input_requests = get_samples(args, tokenizer)

    # keep the garbage collector off the long-lived prompt data during the run; unfrozen for callers
    gc.collect()
    gc.freeze()
    try:
        benchmark_result = asyncio.run(
            benchmark(args, api_url, base_url, model_id, tokenizer, input_requests, goodput_config_dict))
    finally:
        gc.unfreeze()

    # setup, metadata and traffic first, then the measured results
    current_dt = datetime.now().strftime("%Y%m%d-%H%M%S")
    result_json: dict[str, Any] = {"date": current_dt, "backend": args.backend, "model_id": model_id,
                                   "tokenizer_id": tokenizer_id, "best_of": args.best_of,
                                   "num_prompts": args.num_prompts}
    for item in args.metadata or []:
        key, value = item.split("=", 1)
        result_json[key.strip()] = value.strip()
    result_json.update(request_rate=args.request_rate if args.request_rate < float("inf") else "inf",
                       burstiness=args.burstiness, max_concurrency=args.max_concurrency, **benchmark_result)
    if args.save_result:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        file_name = args.result_filename or (
            f"{args.backend}-{args.request_rate}qps{concurrency}-{model_id.split('/')[-1]}-{current_dt}.json")
        if args.result_dir:
            os.makedirs(args.result_dir, exist_ok=True)
            file_name = os.path.join(args.result_dir, file_name)
        write_to_json(file_name, result_json)
        logger.info("Saved results to %s", file_name)
        save_to_pytorch_benchmark_format(args, result_json, file_name)
    return result_json


# (flags, argparse keyword arguments) per argument group, in vLLM's names and order
ARGUMENTS: dict[str | None, list[tuple[tuple[str, ...], dict[str, Any]]]] = {
    None: [
        (("--backend",), dict(default="vllm", choices=list(BACKENDS), help="Serving backend protocol to use.")),
        (("--base-url",), dict(help="Server or API base url if not using http host and port.")),
        (("--host",), dict(default="127.0.0.1")),  # 127.0.0.1 rather than localhost forces IPv4
        (("--port",), dict(type=int, default=8000)),
        (("--endpoint",), dict(default="/v1/completions", help="API endpoint.")),
        (("--dataset-name",), dict(default="sharegpt", choices=DATASET_NAMES, help="Dataset to benchmark on.")),
        (("--dataset-path",), dict(help="Path to the sharegpt/sonnet/burstgpt dataset file, or to a local Hugging "
                                        "Face dataset (directory or file) for --dataset-name hf.")),
        (("--max-concurrency",), dict(type=int, help="Maximum number of concurrent requests. Requests wait for a "
                                      "free slot, so the achieved rate may be lower than --request-rate.")),
        (("--model",), dict(help="Name of the model (default: the one the server reports at /v1/models).")),
        (("--tokenizer",), dict(help="Name or path of the tokenizer, if not using the default tokenizer.")),
        (("--best-of",), dict(type=int, default=1, help="Generates `best_of` sequences per prompt.")),
        (("--num-prompts",), dict(type=int, default=1000, help="Number of prompts to process.")),
        (("--logprobs",), dict(type=int, help="Number of logprobs-per-token to request (default: none).")),
        (("--request-rate",), dict(type=float, default=float("inf"), help="Requests per second. inf sends every "
                                   "request at time 0; otherwise arrivals are a Poisson or gamma process.")),
        (("--burstiness",), dict(type=float, default=1.0, help="Burstiness factor (finite rates only): 1 is a "
                                 "Poisson process, lower is burstier, higher more uniform (gamma-distributed gaps).")),
        (("--seed",), dict(type=int, default=0)),
        (("--trust-remote-code",), dict(action="store_true", help="Trust remote code from huggingface.")),
        (("--disable-tqdm",), dict(action="store_true", help="Specify to disable tqdm progress bar.")),
        (("--profile",), dict(action="store_true", help="POST /start_profile before and /stop_profile after the run "
                              "(the server needs --torch-profiler-dir or ATOM_TORCH_PROFILER_DIR).")),
        (("--save-result",), dict(action="store_true", help="Specify to save benchmark results to a json file.")),
        (("--metadata",), dict(metavar="KEY=VALUE", nargs="*", help="Key-value pairs (e.g. --metadata version=0.3.3 "
                               "tp=1) saved in the result JSON file for record keeping.")),
        (("--result-dir",), dict(help="Directory for the result JSON (default: the current directory).")),
        (("--result-filename",), dict(help="File name of the result JSON (default: "
                                      "{backend}-{request_rate}qps[-concurrency{N}]-{model}-{date}.json).")),
        (("--ignore-eos",), dict(action="store_true", help="Set ignore_eos in the requests (not supported by "
                                 "deepspeed-mii and tgi).")),
        (("--percentile-metrics",), dict(default="ttft,tpot,itl", help="Comma-separated metrics to report "
                                         'percentiles for, of "ttft", "tpot", "itl", "e2el".')),
        (("--metric-percentiles",), dict(default="99", help='Comma-separated percentiles, e.g. "25,50,75".')),
        (("--goodput",), dict(nargs="+", help='Service level objectives as "KEY:VALUE" pairs in ms, keys "ttft", '
                              '"tpot", "e2el" (goodput as in DistServe, https://arxiv.org/pdf/2401.09670).')),
        (("--num-warmups",), dict(type=int, default=0, help="Warm-up requests sent after the initial test request "
                                  "and before the measured run (not counted).")),
        (("--tokenizer-mode",), dict(default="auto", choices=["auto", "slow"], help='"auto" uses the fast tokenizer '
                                     'if available, "slow" always the slow one.')),
        (("--served-model-name",), dict(help="The model name used in the API (default: --model).")),
        (("--lora-modules",), dict(nargs="+", help="LoRA module names served by the server; each request uses one "
                                   "chosen at random.")),
    ],
    "sonnet dataset options": [
        (("--sonnet-input-len",), dict(type=int, default=550, help="Input tokens per request.")),
        (("--sonnet-output-len",), dict(type=int, default=150, help="Output tokens per request.")),
        (("--sonnet-prefix-len",), dict(type=int, default=200, help="Prefix tokens per request.")),
    ],
    "sharegpt dataset options": [
        (("--sharegpt-output-len",), dict(type=int, help="Output length, overriding the dataset's.")),
    ],
    "random dataset options": [
        (("--random-input-len",), dict(type=int, default=1024, help="Input tokens per request.")),
        (("--random-output-len",), dict(type=int, default=128, help="Output tokens per request.")),
        (("--random-range-ratio",), dict(type=float, default=1.0, help="Lengths are drawn uniformly from "
                                         "[length * ratio, length]; 1.0 gives fixed lengths.")),
        (("--random-prefix-len",), dict(type=int, default=0, help="Fixed prefix tokens shared by all requests, "
                                        "before the random context.")),
        (("--use-chat-template",), dict(action="store_true", help="Format prompts with the chat template (its "
                                        "tokens count towards --random-input-len).")),
    ],
    "hf dataset options": [
        (("--hf-subset",), dict(help="Subset of the HF dataset (a sub-directory of --dataset-path).")),
        (("--hf-split",), dict(help="Split of the HF dataset.")),
        (("--hf-output-len",), dict(type=int, help="Output length, overriding the dataset's.")),
    ],
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Benchmark the online serving throughput.")
    for group, arguments in ARGUMENTS.items():
        target = parser.add_argument_group(group) if group else parser
        for flags, kwargs in arguments:
            target.add_argument(*flags, **kwargs)
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
