"""Unit tests for the serving benchmark (atom.benchmarks).

Everything runs offline: the tokenizer is a tiny byte-level BPE trained here
on a few sentences. The end-to-end run against a real atom server lives with
the server's tests.
"""

import argparse
import asyncio
import csv
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from atom.benchmarks import benchmark_serving as bs
from atom.benchmarks.backend_request_func import (
    BACKENDS,
    RequestFuncInput,
    RequestFuncOutput,
    async_request,
    check_api_url,
    client_session,
)
from atom.benchmarks.datasets import (
    BurstGPTDataset,
    HuggingFaceDataset,
    RandomDataset,
    SampleRequest,
    ShareGPTDataset,
    SonnetDataset,
    num_tokens,
)

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Serving benchmarks measure time to first token and inter-token latency.",
    "A paged KV cache lets the engine batch many requests at once.",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}User: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES * 5, trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


# ---------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------


def _outputs() -> tuple[list[SampleRequest], list[RequestFuncOutput]]:
    requests = [SampleRequest("p", n, 10) for n in (10, 20, 30, 40)]
    outputs = [
        # TPOT = (1.0 - 0.1) / (10 - 1) = 0.1 s
        RequestFuncOutput(success=True, ttft=0.1, latency=1.0, itl=[0.2, 0.3, 0.4], output_tokens=10),
        # TPOT = (0.9 - 0.3) / (5 - 1) = 0.15 s
        RequestFuncOutput(success=True, ttft=0.3, latency=0.9, itl=[0.1, 0.3], output_tokens=5),
        RequestFuncOutput(success=False, error="boom"),
        # A single output token: no TPOT (counts as 0 for goodput).
        RequestFuncOutput(success=True, ttft=0.2, latency=0.2, itl=[], output_tokens=1),
    ]
    return requests, outputs


def test_calculate_metrics_exact_values(tokenizer):
    requests, outputs = _outputs()
    metrics, output_lens = bs.calculate_metrics(
        requests, outputs, 2.0, tokenizer, ["ttft", "tpot", "itl", "e2el"], [50.0, 99.0], {}
    )
    approx = pytest.approx
    assert output_lens == [10, 5, 0, 1]
    assert metrics.completed == 3
    assert metrics.total_input == 10 + 20 + 40
    assert metrics.total_output == 16
    assert metrics.request_throughput == approx(1.5)
    assert metrics.output_throughput == approx(8.0)
    assert metrics.total_token_throughput == approx((70 + 16) / 2.0)
    assert metrics.request_goodput == 0.0

    # TTFT: [0.1, 0.3, 0.2] s
    assert metrics.mean_ttft_ms == approx(200.0)
    assert metrics.median_ttft_ms == approx(200.0)
    assert metrics.std_ttft_ms == approx(math.sqrt(0.02 / 3) * 1000)
    # Linear interpolation on the sorted values [0.1, 0.2, 0.3]: rank 0.99 * 2 = 1.98.
    assert metrics.percentiles_ttft_ms == [(50.0, approx(200.0)), (99.0, approx(298.0))]
    # TPOT: [0.1, 0.15] s
    assert metrics.mean_tpot_ms == approx(125.0)
    assert metrics.median_tpot_ms == approx(125.0)
    assert metrics.std_tpot_ms == approx(25.0)
    assert metrics.percentiles_tpot_ms[1] == (99.0, approx(149.5))
    # ITL: [0.2, 0.3, 0.4, 0.1, 0.3] s
    assert metrics.mean_itl_ms == approx(260.0)
    assert metrics.median_itl_ms == approx(300.0)
    assert metrics.percentiles_itl_ms[1] == (99.0, approx(396.0))
    # E2EL: [1.0, 0.9, 0.2] s
    assert metrics.mean_e2el_ms == approx(700.0)
    assert metrics.median_e2el_ms == approx(900.0)
    assert metrics.percentiles_e2el_ms[1] == (99.0, approx(998.0))


@pytest.mark.parametrize(
    "slos, good",
    [
        ({"ttft": 250.0, "tpot": 120.0}, 2),  # the second request misses the TTFT SLO
        ({"ttft": 1000.0}, 3),
        ({"tpot": 100.0}, 2),  # exactly on the SLO is good; 150 ms is not
        ({"e2el": 800.0}, 1),
        ({"ttft": 50.0}, 0),
    ],
)
def test_request_goodput(tokenizer, slos, good):
    requests, outputs = _outputs()
    metrics, _ = bs.calculate_metrics(requests, outputs, 2.0, tokenizer, ["ttft"], [99.0], slos)
    assert metrics.request_goodput == pytest.approx(good / 2.0)


def test_output_tokens_counted_with_tokenizer_when_unknown(tokenizer):
    text = "The quick brown fox jumps"
    output = RequestFuncOutput(success=True, ttft=0.1, latency=0.5, generated_text=text, output_tokens=None)
    metrics, output_lens = bs.calculate_metrics(
        [SampleRequest("p", 3, 10)], [output], 1.0, tokenizer, ["ttft"], [99.0], {}
    )
    expected = len(tokenizer(text, add_special_tokens=False).input_ids)
    assert output_lens == [expected]
    assert metrics.mean_tpot_ms == pytest.approx(400.0 / (expected - 1))


def test_all_requests_failed_reports_zeros(tokenizer):
    outputs = [RequestFuncOutput(success=False, error="x")] * 2
    with pytest.warns(UserWarning, match="All requests failed"):
        metrics, output_lens = bs.calculate_metrics(
            [SampleRequest("p", 5, 5)] * 2, outputs, 1.0, tokenizer, ["ttft"], [99.0], {"ttft": 10.0}
        )
    assert output_lens == [0, 0]
    assert metrics.completed == 0 and metrics.request_goodput == 0.0
    assert metrics.mean_ttft_ms == 0.0 and metrics.percentiles_itl_ms == [(99.0, 0.0)]


def test_result_table_and_keys(tokenizer, capsys):
    requests, outputs = _outputs()
    selected = ["ttft", "e2el"]
    metrics, output_lens = bs.calculate_metrics(
        requests, outputs, 2.0, tokenizer, selected, [99.0, 99.9], {"ttft": 250.0}
    )
    result = bs.print_and_collect_results(metrics, 2.0, outputs, output_lens, selected, {"ttft": 250.0})
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table
    assert "Request goodput (req/s):" in table
    assert "P99.9 TTFT (ms):" in table and "Mean E2EL (ms):" in table
    assert "TPOT" not in table  # not selected
    for key in (
        "duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
        "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens",
        "ttfts", "itls", "generated_texts", "errors", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms",
        "p99_ttft_ms", "p99.9_ttft_ms", "p99_e2el_ms",
    ):  # fmt: skip
        assert key in result, key
    assert "mean_tpot_ms" not in result
    assert result["request_goodput"] == pytest.approx(1.0)
    assert result["errors"][2] == "boom"
    assert result["output_lens"] == [10, 5, 0, 1]


def test_goodput_argument_parsing():
    def goodput(*pairs):
        return bs.check_goodput_args(argparse.Namespace(goodput=list(pairs) or None))

    assert goodput() == {}
    assert goodput("ttft:100", "tpot:50", "e2el:2000") == {"ttft": 100.0, "tpot": 50.0, "e2el": 2000.0}
    with pytest.raises(ValueError, match="Invalid metric name"):
        goodput("itl:5")
    with pytest.raises(ValueError, match="non-negative"):
        goodput("ttft:-1")
    with pytest.raises(argparse.ArgumentTypeError):
        goodput("ttft=100")


# ---------------------------------------------------------------------------
# Request arrivals
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_keep_the_mean_rate(burstiness):
    rate, n = 10.0, 40001
    times = bs.arrival_times(n, rate, burstiness, np.random.default_rng(0))
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert (n - 1) / times[-1] == pytest.approx(rate, rel=0.03)
    # Gamma with shape k has a coefficient of variation of 1 / sqrt(k):
    # burstier traffic (k < 1) has more irregular gaps.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_everything_at_once():
    assert np.array_equal(bs.arrival_times(5, float("inf"), 0.5), np.zeros(5))
    with pytest.raises(ValueError, match="burstiness"):
        bs.arrival_times(5, 1.0, 0.0)


def test_get_request_follows_arrival_times():
    requests = [SampleRequest(str(i), 1, 1) for i in range(21)]
    expected = bs.arrival_times(21, 100.0, 1.0, np.random.default_rng(3))

    async def collect():
        start = time.perf_counter()
        seen = []
        async for request in bs.get_request(requests, 100.0, 1.0, np.random.default_rng(3)):
            seen.append((request.prompt, time.perf_counter() - start))
        return seen

    seen = asyncio.run(collect())
    assert [p for p, _ in seen] == [r.prompt for r in requests]
    for (_, sent_at), planned in zip(seen, expected):
        assert sent_at >= planned - 1e-3
    assert seen[-1][1] == pytest.approx(expected[-1], abs=0.1)


# ---------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------


def test_random_dataset_fixed_lengths(tokenizer):
    reqs = RandomDataset(random_seed=0).sample(tokenizer, 30, input_len=48, output_len=12, range_ratio=1.0)
    assert len(reqs) == 30
    assert {r.prompt_len for r in reqs} == {48}
    assert {r.expected_output_len for r in reqs} == {12}
    assert all(num_tokens(tokenizer, r.prompt) == r.prompt_len for r in reqs)
    assert len({r.prompt for r in reqs}) == 30
    assert all("<|endoftext|>" not in r.prompt for r in reqs)


def test_random_dataset_range_ratio(tokenizer):
    reqs = RandomDataset(random_seed=1).sample(tokenizer, 200, input_len=40, output_len=20, range_ratio=0.5)
    in_lens = [r.prompt_len for r in reqs]
    out_lens = [r.expected_output_len for r in reqs]
    assert min(in_lens) >= 20 and max(in_lens) <= 40
    assert min(out_lens) >= 10 and max(out_lens) <= 20
    assert len(set(in_lens)) > 10 and len(set(out_lens)) > 5
    assert all(num_tokens(tokenizer, r.prompt) == r.prompt_len for r in reqs)
    with pytest.raises(ValueError, match="range-ratio"):
        RandomDataset().sample(tokenizer, 1, input_len=8, output_len=8, range_ratio=1.5)


def test_random_dataset_prefix(tokenizer):
    reqs = RandomDataset(random_seed=2).sample(tokenizer, 20, input_len=40, output_len=8, prefix_len=16)
    assert {r.prompt_len for r in reqs} == {16 + 40}
    shared = os.path.commonprefix([r.prompt for r in reqs])
    # Tokens of the prefix can merge when decoded next to each other.
    assert num_tokens(tokenizer, shared) >= 14
    no_prefix = RandomDataset(random_seed=2).sample(tokenizer, 20, input_len=40, output_len=8)
    assert os.path.commonprefix([r.prompt for r in no_prefix]) == ""


def test_random_dataset_is_seeded(tokenizer):
    def prompts(seed):
        return [r.prompt for r in RandomDataset(random_seed=seed).sample(tokenizer, 5, input_len=20)]

    assert prompts(7) == prompts(7)
    assert prompts(7) != prompts(8)


def test_random_dataset_chat_template(tokenizer):
    reqs = RandomDataset(random_seed=0).sample(tokenizer, 10, input_len=40, output_len=8, use_chat_template=True)
    assert all(r.prompt.startswith("User: ") and r.prompt.endswith("\nAssistant:") for r in reqs)
    # The template's own tokens count towards the input length.
    assert all(abs(r.prompt_len - 40) <= 1 for r in reqs)
    assert all(num_tokens(tokenizer, r.prompt) == r.prompt_len for r in reqs)


def test_sharegpt_dataset(tokenizer, tmp_path):
    conversations = [
        {"conversations": [{"from": "human", "value": SENTENCES[i % 4]}, {"from": "gpt", "value": SENTENCES[3]}]}
        for i in range(3)
    ] + [{"conversations": [{"from": "human", "value": "only one turn"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    reqs = ShareGPTDataset(dataset_path=str(path), random_seed=0).sample(tokenizer, 5)
    assert len(reqs) == 5  # 3 usable entries, oversampled
    assert all(r.prompt in SENTENCES for r in reqs)
    assert all(r.prompt_len == len(tokenizer(r.prompt).input_ids) for r in reqs)
    assert {r.expected_output_len for r in reqs} == {len(tokenizer(SENTENCES[3]).input_ids)}
    fixed = ShareGPTDataset(dataset_path=str(path)).sample(tokenizer, 2, output_len=7)
    assert {r.expected_output_len for r in fixed} == {7}
    with pytest.raises(ValueError, match="dataset-path"):
        ShareGPTDataset(dataset_path=None)


def test_sonnet_dataset(tokenizer, tmp_path):
    path = tmp_path / "sonnet.txt"
    path.write_text("\n".join(SENTENCES * 3) + "\n")
    reqs = SonnetDataset(dataset_path=str(path), random_seed=0).sample(
        tokenizer, 4, prefix_len=30, input_len=200, output_len=9, return_prompt_formatted=True
    )
    assert len(reqs) == 4
    assert all(r.prompt.startswith("User: Pick as many lines") for r in reqs)
    assert all(r.prompt_len <= 200 and r.expected_output_len == 9 for r in reqs)


def test_burstgpt_dataset(tokenizer, tmp_path):
    path = tmp_path / "burstgpt.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"])
        writer.writerow([0, "GPT-4", 30, 12, 42, "Conversation log"])
        writer.writerow([1, "ChatGPT", 50, 10, 60, "Conversation log"])
        writer.writerow([2, "GPT-4", 20, 0, 20, "Conversation log"])  # failed request
        writer.writerow([3, "GPT-4", 25, 8, 33, "API log"])
    reqs = BurstGPTDataset(dataset_path=str(path), random_seed=0).sample(tokenizer, 6)
    assert len(reqs) == 6
    assert {(r.prompt_len, r.expected_output_len) for r in reqs} <= {(30, 12), (25, 8)}
    assert all(num_tokens(tokenizer, r.prompt) == r.prompt_len for r in reqs)


def test_hf_dataset_local_file_only(tokenizer, tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"problem": SENTENCES[0], "solution": SENTENCES[1]}, {"instruction": "Fix", "input": SENTENCES[2]}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    reqs = HuggingFaceDataset(dataset_path=str(path), random_seed=0).sample(tokenizer, 2, output_len=16)
    assert sorted(r.prompt for r in reqs) == sorted([SENTENCES[0], f"Fix:\n{SENTENCES[2]}"])
    assert {r.expected_output_len for r in reqs} == {16}
    with pytest.raises(ValueError, match="only read from local data"):
        HuggingFaceDataset(dataset_path="AI-MO/aimo-validation-aime")


# ---------------------------------------------------------------------------
# Request functions and arguments
# ---------------------------------------------------------------------------


def test_backends_and_endpoints():
    # every backend speaks the OpenAI API: the name only labels the results
    assert set(BACKENDS) == {
        "vllm", "openai", "openai-chat", "tgi", "tensorrt-llm", "deepspeed-mii", "lmdeploy", "scalellm", "sglang",
    }  # fmt: skip
    check_api_url("vllm", "http://h:1/v1/completions")
    check_api_url("tgi", "http://h:1/v1/completions")
    check_api_url("openai-chat", "http://h:1/v1/chat/completions")
    with pytest.raises(ValueError, match="chat/completions"):
        check_api_url("openai-chat", "http://h:1/v1/completions")
    with pytest.raises(ValueError, match="completions"):
        check_api_url("tensorrt-llm", "http://h:1/generate_stream")
    with pytest.raises(ValueError, match="Unknown backend"):
        check_api_url("no-such-backend", "http://h:1/v1/completions")


def test_argument_defaults_match_the_guide():
    args = bs.parse_args([])  # without --model the server is asked which model it serves
    expected = {
        "backend": "vllm",
        "model": None,
        "base_url": None,
        "host": "127.0.0.1",
        "port": 8000,
        "endpoint": "/v1/completions",
        "dataset_name": "sharegpt",
        "dataset_path": None,
        "num_prompts": 1000,
        "request_rate": float("inf"),
        "burstiness": 1.0,
        "max_concurrency": None,
        "ignore_eos": False,
        "save_result": False,
        "result_dir": None,
        "result_filename": None,
        "percentile_metrics": "ttft,tpot,itl",
        "metric_percentiles": "99",
        "goodput": None,
        "profile": False,
        "tokenizer": None,
        "seed": 0,
        "random_input_len": 1024,
        "random_output_len": 128,
        "random_range_ratio": 1.0,
        "random_prefix_len": 0,
        "use_chat_template": False,
    }
    assert {k: getattr(args, k) for k in expected} == expected


def test_guide_example_arguments_parse():
    args = bs.parse_args(
        "--model=deepseek-ai/DeepSeek-R1 --backend=vllm --base-url=http://localhost:8000 "
        "--dataset-name=random --random-input-len=1024 --random-output-len=1024 "
        "--random-range-ratio 0.8 --num-prompts=1280 --max-concurrency=128 --request-rate=inf "
        "--ignore-eos --save-result --percentile-metrics=ttft,tpot,itl,e2el --result-dir=./ "
        "--result-filename=Deepseek-R1-result.json --goodput ttft:100 tpot:50".split()
    )
    assert args.random_range_ratio == 0.8 and args.max_concurrency == 128
    assert args.request_rate == float("inf") and args.ignore_eos and args.save_result
    assert args.goodput == ["ttft:100", "tpot:50"]


def test_main_reports_an_unreachable_server(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "tok")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = bs.parse_args(
        ["--model", "tiny", "--tokenizer", str(tmp_path / "tok"), "--port", str(port)]
        + ["--dataset-name", "random", "--random-input-len", "16", "--num-prompts", "2", "--disable-tqdm"]
    )
    with pytest.raises(bs.BenchmarkError, match="Cannot connect to http://127.0.0.1"):
        bs.main(args)


# ---------------------------------------------------------------------------
# The shared client against a real HTTP server on 127.0.0.1
# ---------------------------------------------------------------------------

WORDS = ["The", " quick", " brown", " fox", " jumps"]


def _sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


class ProtocolServer:
    """A small aiohttp server speaking the OpenAI streaming API, WORDS one event at a time; the prompt
    "split" sends the stream in 7-byte writes (events and characters cut anywhere), the prompt "long"
    one token of 300,000 characters (an event far over aiohttp's 64 KiB line buffer)."""

    def __init__(self, tokenizer_dir: str) -> None:
        self.bodies: list[dict] = []
        self.tokenizer_dir = tokenizer_dir
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def _start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._openai)
        app.router.add_post("/v1/chat/completions", self._openai)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny", "root": self.tokenizer_dir}]})

    async def _openai(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if body["model"] != "tiny":
            return web.json_response({"error": {"message": f"model {body['model']} not found"}}, status=404)
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        words = ["\u00e9" * 300_000] if prompt == "long" else WORDS[: body["max_tokens"]]
        events = [{"choices": [{"delta": {"role": "assistant"}}]}] if chat else []
        events += [{"choices": [{"delta": {"content": w}} if chat else {"text": w}]} for w in words]
        events += [{"choices": [], "usage": {"completion_tokens": len(words)}}, b"data: [DONE]\n\n"]
        writes = [b": ping\n\n"] + [_sse(e) if not isinstance(e, bytes) else e for e in events]
        if prompt == "split":
            stream = b"".join(writes)
            writes = [stream[i : i + 7] for i in range(0, len(stream), 7)]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for data in writes:  # one write per event, so that every token arrives on its own
            await response.write(data)
        await response.write_eof()
        return response

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.fixture(scope="module")
def protocol_server(tokenizer, tmp_path_factory):
    tokenizer_dir = tmp_path_factory.mktemp("tok")
    tokenizer.save_pretrained(tokenizer_dir)
    server = ProtocolServer(str(tokenizer_dir))
    yield server
    server.close()


def _send(backend: str, url: str, prompt: str = "Hi there", **kwargs) -> RequestFuncOutput:
    request = RequestFuncInput(prompt, url, prompt_len=2, output_len=len(WORDS), model="tiny", **kwargs)

    async def run():
        async with client_session() as session:
            return await async_request(backend, request, session)

    return asyncio.run(run())


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_one_client_speaks_every_backend(protocol_server, backend):
    output = _send(backend, f"{protocol_server.url}/v1/{BACKENDS[backend]}", ignore_eos=True)
    assert output.success, output.error
    assert output.generated_text == "".join(WORDS)
    # a token per event: TTFT, then one gap per further token (the chat role chunk is not one)
    assert 0 < output.ttft <= output.latency and len(output.itl) == len(WORDS) - 1
    body = protocol_server.bodies[-1]
    assert ("messages" if backend == "openai-chat" else "prompt") in body
    assert output.output_tokens == len(WORDS) and body["ignore_eos"] is True and body["stream"] is True
    assert output.tpot == pytest.approx((output.latency - output.ttft) / (len(WORDS) - 1))


@pytest.mark.parametrize("backend", ["vllm", "openai-chat"])
def test_client_reads_events_split_anywhere_and_longer_than_64_kib(protocol_server, backend):
    url = f"{protocol_server.url}/v1/{BACKENDS[backend]}"
    split = _send(backend, url, prompt="split")
    assert split.success and split.generated_text == "".join(WORDS) and split.output_tokens == len(WORDS)
    long = _send(backend, url, prompt="long")
    assert long.success, long.error
    assert long.generated_text == "\u00e9" * 300_000 and long.output_tokens == 1 and long.itl == []


def test_client_reports_http_errors(protocol_server):
    output = _send("vllm", protocol_server.url + "/v1/completions", model_name="no-such-model")
    assert not output.success and output.error.startswith("HTTP 404") and "no-such-model" in output.error


def test_main_against_a_server_with_the_served_model(protocol_server, tmp_path):
    # no --model: the model and its tokenizer come from the server's /v1/models
    args = bs.parse_args([
        "--base-url", protocol_server.url, "--dataset-name", "random", "--random-input-len", "12",
        "--random-output-len", "4", "--num-prompts", "6", "--max-concurrency", "2", "--ignore-eos",
        "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99.9",
        "--goodput", "ttft:60000", "--metadata", "run=unit", "--save-result", "--result-dir", str(tmp_path),
    ])  # fmt: skip
    result = bs.main(args)
    [saved] = list(tmp_path.glob("vllm-infqps-concurrency2-tiny-*.json"))
    assert json.loads(saved.read_text()) == json.loads(json.dumps(result).replace("Infinity", '"inf"'))
    expected = {
        "date", "backend", "model_id", "tokenizer_id", "best_of", "num_prompts", "run", "request_rate", "burstiness",
        "max_concurrency", "duration", "completed", "total_input_tokens", "total_output_tokens",
        "request_throughput", "request_goodput", "output_throughput", "total_token_throughput", "input_lens",
        "output_lens", "ttfts", "itls", "generated_texts", "errors",
    } | {f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p50", "p99.9")}
    assert set(result) == expected
    assert result["model_id"] == "tiny" and result["tokenizer_id"] == protocol_server.tokenizer_dir
    assert result["completed"] == 6 and result["total_output_tokens"] == 6 * 4 and result["request_rate"] == "inf"
    assert result["run"] == "unit" and result["request_goodput"] > 0
    assert result["input_lens"] == [12] * 6 and result["generated_texts"] == ["".join(WORDS[:4])] * 6


# ---------------------------------------------------------------------------
# The command line: documented flags, and one-line errors
# ---------------------------------------------------------------------------


def test_every_documented_flag_parses():
    doc = (Path(__file__).parents[2] / "docs" / "benchmark_serving.md").read_text()
    # the first column of the argument tables
    documented = set(re.findall(r"^\| `(--[a-z][a-z-]+)`", doc, flags=re.MULTILINE))
    known = set(bs.build_parser()._option_string_actions)
    assert len(documented) >= 40 and documented <= known, documented - known
    for group in bs.ARGUMENTS.values():  # and every flag of the parser is documented
        assert {row[0] for row in group} <= documented


def test_unknown_tokenizer_fails_fast_in_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    run = subprocess.run(
        [sys.executable, "-m", "atom.benchmarks.benchmark_serving", "--model", "no-such-org/no-such-model",
         "--port", str(port), "--dataset-name", "random"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    errors = [line for line in run.stderr.splitlines() if " ERROR " in line]
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert len(errors) == 1 and "no-such-org/no-such-model" in errors[0] and "--tokenizer" in errors[0]
