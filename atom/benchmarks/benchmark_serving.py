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
import json
import logging
import os
import random
import socket
import sys
import time
import urllib.parse
import urllib.request
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
    BACKENDS,
    RequestFuncInput,
    RequestFuncOutput,
    async_request,
    check_api_url,
)
from atom.benchmarks.benchmark_utils import save_to_pytorch_benchmark_format, write_to_json
from atom.benchmarks.datasets import DATASET_NAMES, SampleRequest, get_samples

logger = logging.getLogger(__name__)

# metric -> (short name, table header); the order of the result table
METRICS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
PERCENTILE_METRICS = list(METRICS)
GOODPUT_METRICS = ["ttft", "tpot", "e2el"]


class BenchmarkError(RuntimeError):
    """The benchmark cannot run, e.g. the server is unreachable or the tokenizer cannot be loaded."""


@dataclass
class BenchmarkMetrics:
    completed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    # for each of ttft, tpot, itl, e2el (e2el: end-to-end latency per request, measured on the client)
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
    mean_e2el_ms: float
    median_e2el_ms: float
    std_e2el_ms: float
    percentiles_e2el_ms: list[tuple[float, float]]


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
        **stats)  # fmt: skip
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


def served_model(base_url: str) -> tuple[str, str | None]:
    """(id, root) of the first model of the server's ``GET /v1/models``; root is the path it loaded."""
    api_key = os.environ.get("OPENAI_API_KEY")
    request = urllib.request.Request(f"{base_url}/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            card = json.load(response)["data"][0]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise BenchmarkError(f"Cannot ask {base_url}/v1/models which model is served ({exc}); start the server "
                             "or pass --model") from exc
    return card["id"], card.get("root")


def _hub_reachable() -> bool:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urllib.parse.urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
        return True
    except OSError:
        return False


def get_tokenizer(name: str, tokenizer_mode: str = "auto", trust_remote_code: bool = False, **kwargs):
    """A Hugging Face tokenizer from a local directory, the hub cache, or the hub when it answers.

    Without a network transformers retries the hub for about a minute before failing, so a name
    that is neither local nor cached fails at once when the hub cannot be reached."""
    from transformers import AutoTokenizer

    kwargs.update(trust_remote_code=trust_remote_code, **({"use_fast": False} if tokenizer_mode == "slow" else {}))
    if not os.path.exists(name):
        with contextlib.suppress(OSError):
            return AutoTokenizer.from_pretrained(name, local_files_only=True, **kwargs)
        if not _hub_reachable():
            raise BenchmarkError(f"Cannot load the tokenizer {name!r}: it is not a local path nor in the Hugging Face "
                                 "cache, and the hub cannot be reached. Pass --tokenizer DIR (a directory with the "
                                 "model's tokenizer files), or leave out --model to use the server's model.")
    return AutoTokenizer.from_pretrained(name, **kwargs)


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
