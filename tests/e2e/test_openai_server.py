"""The OpenAI-compatible server, end to end: a real server subprocess on 127.0.0.1 with a
tiny float32 checkpoint on the CPU, driven by the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import asyncio
import glob
import http.client
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import openai
import psutil
import pytest
import requests
from server_process import MAX_MODEL_LEN, assert_all_blocks_free, assert_serving, wait_until

from atom import LLMEngine, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, a small model",
    "def add(a, b):",
    "Paged attention stores keys and values",
    "The quick brown fox",
    "Continuous batching lets new requests",
    "Prefix caching reuses the KV cache",
    "机器学习 模型 推理",
]
API_KEY = "atom-e2e-key"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a capital city."}]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """The in-process engine on the same checkpoint: what the server must reproduce."""
    return LLMEngine(tiny_model, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
                     kv_cache_memory_bytes=32 << 20)


def greedy(reference: LLMEngine, prompts, max_tokens: int) -> list[dict]:
    return reference.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)


def chat_prompt_ids(reference: LLMEngine, messages) -> list[int]:
    text = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return reference.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=120)


def sse_events(response: requests.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]


# basic endpoints


def test_health_and_models(server, client, tiny_model):
    assert requests.get(f"{server.url}/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny_model]


# greedy output equals LLMEngine.generate


def test_completion_matches_llm_engine(client, reference, tiny_model):
    expected = greedy(reference, PROMPTS[:4], max_tokens=12)
    out = client.completions.create(model=tiny_model, prompt=PROMPTS[:4], max_tokens=12, temperature=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [e["text"] for e in expected]
    assert [c.finish_reason for c in out.choices] == [e["finish_reason"] for e in expected]
    assert out.usage.prompt_tokens == sum(e["num_tokens_input"] for e in expected)
    assert out.usage.completion_tokens == sum(e["num_tokens_output"] for e in expected)


def test_token_id_prompt(client, reference, tiny_model):
    ids = reference.tokenizer.encode(PROMPTS[0])
    [expected] = greedy(reference, [ids], max_tokens=8)
    out = client.completions.create(model=tiny_model, prompt=ids, max_tokens=8, temperature=0)
    assert out.choices[0].text == expected["text"]


def test_chat_matches_llm_engine(client, reference, tiny_model):
    [expected] = greedy(reference, [chat_prompt_ids(reference, MESSAGES)], max_tokens=12)
    out = client.chat.completions.create(model=tiny_model, messages=MESSAGES, max_tokens=12, temperature=0)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected["text"]
    assert out.usage.prompt_tokens == expected["num_tokens_input"]
    assert out.usage.completion_tokens == expected["num_tokens_output"]


def test_usage_timing_fields(server):
    usage = server.post("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 6, "ignore_eos": True}).json()["usage"]
    assert usage["completion_tokens"] == 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + 6
    assert 0 < usage["ttft_s"] <= usage["latency_s"]
    assert usage["tpot_s"] > 0


# streaming


def test_streaming_completion(server, client, tiny_model):
    full = client.completions.create(model=tiny_model, prompt=PROMPTS[2], max_tokens=10, temperature=0)
    stream = client.completions.create(model=tiny_model, prompt=PROMPTS[2], max_tokens=10, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # raw SSE: every event is JSON, the last is [DONE]
    r = server.post("/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 4, "stream": True}, stream=True)
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])


def test_streaming_chat(server, client, tiny_model):
    full = client.chat.completions.create(model=tiny_model, messages=MESSAGES, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=tiny_model, messages=MESSAGES, max_tokens=10,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.ttft_s is not None  # the extra timing fields ride along
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "stream": True}, stream=True)
    assert sse_events(r)[-1] == "[DONE]"


# n > 1, stop strings, logprobs


def test_n_samples(client, tiny_model):
    out = client.completions.create(model=tiny_model, prompt=PROMPTS[0], max_tokens=8, n=3, temperature=1.0,
                                    seed=1, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 24
    assert len({c.text for c in out.choices}) > 1  # each sample has its own seed
    again = client.completions.create(model=tiny_model, prompt=PROMPTS[0], max_tokens=8, n=3, temperature=1.0,
                                      seed=1, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible
    chat = client.chat.completions.create(model=tiny_model, messages=MESSAGES, max_tokens=5, n=2, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    stream = client.chat.completions.create(model=tiny_model, messages=MESSAGES, max_tokens=5, n=2, temperature=0,
                                            stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] == texts[1] == chat.choices[0].message.content


def test_stop_strings(client, reference, tiny_model):
    [expected] = greedy(reference, [PROMPTS[4]], max_tokens=16)
    text = expected["text"]
    stop = text[4:7]
    assert len(text) > 8 and stop, text
    want = text[: text.index(stop)]
    for stream in (False, True):
        for stop_arg in (stop, [stop, "never-appears"]):
            out = client.completions.create(model=tiny_model, prompt=PROMPTS[4], max_tokens=16, temperature=0,
                                            stop=stop_arg, stream=stream)
            chunks = list(out) if stream else [out]
            assert "".join(c.choices[0].text for c in chunks) == want
            assert chunks[-1].choices[0].finish_reason == "stop"


def test_return_token_ids(client, reference, tiny_model):
    """vLLM's return_token_ids: the prompt's and the output's ids beside the text, streamed as the
    prompt's in the first chunk and each chunk's new ones; null without it."""
    [plain] = greedy(reference, [PROMPTS[0]], max_tokens=6)
    prompt_ids = reference.tokenizer.encode(PROMPTS[0])
    messages = [{"role": "user", "content": PROMPTS[1]}]
    args = dict(model=tiny_model, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    out = client.completions.create(prompt=PROMPTS[0], **args)
    assert out.choices[0].prompt_token_ids == prompt_ids and out.choices[0].token_ids == plain["token_ids"]
    chunks = list(client.completions.create(prompt=PROMPTS[0], stream=True, **args))
    assert chunks[0].choices[0].prompt_token_ids == prompt_ids
    assert [t for c in chunks for t in c.choices[0].token_ids] == plain["token_ids"]
    chat = client.chat.completions.create(messages=messages, **args)
    assert chat.prompt_token_ids == chat_prompt_ids(reference, messages)
    assert len(chat.choices[0].token_ids) == chat.usage.completion_tokens
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **args))
    assert chunks[0].prompt_token_ids == chat.prompt_token_ids
    assert [t for c in chunks[1:] for t in c.choices[0].token_ids] == chat.choices[0].token_ids
    bare = client.completions.create(model=tiny_model, prompt=PROMPTS[0], max_tokens=2).choices[0]
    assert bare.token_ids is None and bare.prompt_token_ids is None


def test_stop_token_text_and_include_stop_str_in_output(client, reference, tiny_model):
    """As vLLM: a stop token id's text is not in the output (its id is), nor is a stop string;
    ``include_stop_str_in_output`` keeps either."""
    [plain] = greedy(reference, [PROMPTS[4]], max_tokens=16)
    ids, tok = plain["token_ids"], reference.tokenizer
    stop_id = next(t for t in ids[2:] if tok.decode([t]).strip())
    k = ids.index(stop_id)
    texts = {}
    for include in (False, True):
        for stream in (False, True):
            out = client.completions.create(model=tiny_model, prompt=PROMPTS[4], max_tokens=16, temperature=0,
                                            stream=stream, extra_body={"stop_token_ids": [stop_id],
                                                                       "include_stop_str_in_output": include})
            chunks = list(out) if stream else [out]
            assert chunks[-1].choices[0].finish_reason == "stop"
            texts[include, stream] = "".join(c.choices[0].text for c in chunks)
            if not stream:
                assert out.usage.completion_tokens == k + 1  # the stop token is generated (and counted)
    assert texts[False, False] == texts[False, True] and texts[True, False] == texts[True, True]
    assert plain["text"].startswith(texts[True, False])
    assert texts[True, False] == texts[False, False] + texts[True, False][len(texts[False, False]):]
    assert texts[True, False][len(texts[False, False]):].strip() == tok.decode([stop_id]).strip()
    # stop strings
    text = plain["text"]
    stop = text[4:7]
    for stream in (False, True):
        out = client.completions.create(model=tiny_model, prompt=PROMPTS[4], max_tokens=16, temperature=0, stop=stop,
                                        stream=stream, extra_body={"include_stop_str_in_output": True})
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks) == text[: text.index(stop) + len(stop)]


def test_skip_special_tokens(client, reference, tiny_model):
    eos = reference.tokenizer.eos_token_id
    body = dict(model=tiny_model, prompt=PROMPTS[0], max_tokens=2, temperature=0)
    shown = {}
    for skip in (True, False):
        out = client.completions.create(**body, extra_body={"allowed_token_ids": [eos], "ignore_eos": True,
                                                            "skip_special_tokens": skip})
        shown[skip] = out.choices[0].text
    assert shown == {True: "", False: reference.tokenizer.decode([eos, eos], skip_special_tokens=False)}


def test_truncate_prompt_tokens(server, client, reference, tiny_model):
    """vLLM's truncate_prompt_tokens: the last N prompt tokens, also for a prompt longer than the
    context; echo shows the truncated prompt."""
    long = " ".join(["token"] * (MAX_MODEL_LEN + 100))
    out = client.completions.create(model=tiny_model, prompt=long, max_tokens=2, temperature=0, echo=True,
                                    extra_body={"truncate_prompt_tokens": 10})
    ids = reference.tokenizer.encode(long)[-10:]
    assert out.usage.prompt_tokens == 10
    assert out.choices[0].text.startswith(reference.tokenizer.decode(ids))
    chat = client.chat.completions.create(model=tiny_model, messages=MESSAGES, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    for bad in (0, MAX_MODEL_LEN + 1):
        r = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and "truncate_prompt_tokens" in r.json()["error"]["message"]


def test_null_fields_and_vllm_request_options(server, reference, tiny_model):
    """null for a field with a default is that default (OpenAI's clients send it); chat_template_kwargs
    that set add_generation_prompt are used; vLLM fields atom does not implement are a 400 naming
    them, not ignored."""
    r = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "n": None, "stream": None, "echo": None})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1
    r = server.post("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert r.status_code == 200
    assert r.json()["tokens"] == chat_prompt_ids(reference, MESSAGES)[: r.json()["count"]]
    assert r.json()["count"] < len(chat_prompt_ids(reference, MESSAGES))  # no assistant turn started
    r = server.post("/v1/completions", {"prompt": "Hi", "spaces_between_special_tokens": False, "max_tokens": 1})
    assert r.status_code == 400 and "spaces_between_special_tokens" in r.json()["error"]["message"], r.text


def test_content_parts_join_by_newlines(server, reference):
    """OpenAI's list of text parts is one message text, the parts joined by newlines (vLLM's
    "string" content format), in the prompt the server renders."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello."}]}]
    r = server.post("/tokenize", {"messages": parts})
    assert r.status_code == 200
    assert r.json()["tokens"] == chat_prompt_ids(reference, [{"role": "user", "content": "Say\nhello."}])


def test_request_chat_template_needs_trust(server, make_server, reference):
    """A request's own chat_template (or one in chat_template_kwargs) is refused unless the server
    runs with --trust-request-chat-template, as vLLM; then it is used."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    bodies = [("/tokenize", {"messages": MESSAGES, "chat_template": template}),
              ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "chat_template": template}),
              ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                        "chat_template_kwargs": {"chat_template": template}})]  # fmt: skip
    for path, body in bodies:
        r = server.post(path, body)
        assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"], r.text
    trusting = make_server(extra_args=("--trust-request-chat-template",))
    for path, body in bodies:
        assert trusting.post(path, body).status_code == 200
    r = trusting.post("/tokenize", bodies[0][1])
    assert r.json()["tokens"] == reference.tokenizer.encode("".join(m["content"] for m in MESSAGES),
                                                             add_special_tokens=False)
    # an earlier turn's reasoning reaches the template under both names, sent under either (as vLLM)
    shows = "{% for m in messages %}[{{ m.reasoning }}|{{ m.reasoning_content }}]{% endfor %}"
    for name in ("reasoning", "reasoning_content"):
        turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", name: "think"}]
        r = trusting.post("/tokenize", {"messages": turns, "chat_template": shows})
        assert r.json()["tokens"] == reference.tokenizer.encode("[|][think|think]", add_special_tokens=False), r.text


def test_chat_logprobs(client, tiny_model):
    out = client.chat.completions.create(model=tiny_model, messages=MESSAGES, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)


def test_completion_echo_logprobs(client, reference, tiny_model):
    """What lm-eval's loglikelihood tasks send: echo + logprobs + max_tokens=1."""
    prompt = PROMPTS[3]
    n_prompt = len(reference.tokenizer.encode(prompt))
    out = client.completions.create(model=tiny_model, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                    logprobs=1)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:n_prompt]) == prompt
    assert lp.text_offset[1] == len(lp.tokens[0])
    # the prompt's logprobs are the in-process engine's
    reference.add_request([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    [ref] = wait_until(reference.step, timeout=30, interval=0)
    assert lp.token_logprobs[1:n_prompt] == pytest.approx([t.logprob for t in ref.prompt_logprobs[1:]], abs=1e-4)
    # the generated token's logprob equals the non-echo request's
    plain = client.completions.create(model=tiny_model, prompt=prompt, max_tokens=1, temperature=0, logprobs=1)
    assert lp.token_logprobs[-1] == pytest.approx(plain.choices[0].logprobs.token_logprobs[0], abs=1e-4)
    # greedy generated token: its logprob is the best of its top list
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()), abs=1e-5)


def test_prompt_logprobs(server, client, reference, tiny_model):
    """vLLM's prompt_logprobs: None, then per prompt position its token (logprob, rank in the vocabulary,
    text) and the top N; the in-process engine's values. Beside echo's logprobs (with their own N) on
    completions, at the response's top level on chat; not with stream."""
    prompt = PROMPTS[3]
    ids = reference.tokenizer.encode(prompt)
    reference.add_request([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))
    [ref] = wait_until(reference.step, timeout=30, interval=0)
    out = client.completions.create(model=tiny_model, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                    logprobs=1, extra_body={"prompt_logprobs": 3})  # fmt: skip
    got = out.choices[0].prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for token_id, entry, want in zip(ids[1:], got[1:], ref.prompt_logprobs[1:]):
        own = entry[str(token_id)]
        assert own["logprob"] == pytest.approx(want.logprob, abs=1e-4) and own["rank"] == want.rank
        assert own["decoded_token"] == reference.tokenizer.decode([token_id])
        top = {int(t): v for t, v in entry.items() if int(t) != token_id or v["rank"] <= 3}
        assert sorted(v["rank"] for v in top.values()) == [1, 2, 3]
        assert {t: v["logprob"] for t, v in top.items()} == pytest.approx(dict(want.top), abs=1e-4)
    # echo's logprobs keep their own N (1 alternative, the chosen token besides)
    assert all(len(t) <= 2 for t in out.choices[0].logprobs.top_logprobs[1:])
    chat = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])
    r = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stream": True, "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def test_completion_echo_without_generation(client, tiny_model):
    """vLLM's echo with max_tokens=0 (older lm-eval's loglikelihood): the prompt and its logprobs,
    no completion token, streamed or not."""
    prompt = PROMPTS[3]
    ref = client.completions.create(model=tiny_model, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                    logprobs=2)
    out = client.completions.create(model=tiny_model, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice, want = out.choices[0], ref.choices[0].logprobs
    assert choice.text == prompt
    assert choice.logprobs.tokens == want.tokens[:-1]
    assert choice.logprobs.token_logprobs == want.token_logprobs[:-1]
    assert choice.logprobs.text_offset == want.text_offset[:-1]
    assert out.usage.completion_tokens == 0 and out.usage.total_tokens == out.usage.prompt_tokens
    assert choice.finish_reason == "length"
    chunks = list(client.completions.create(model=tiny_model, prompt=prompt, max_tokens=0, echo=True, logprobs=2,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    assert [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == \
        want.tokens[:-1]
    assert chunks[-1].usage.completion_tokens == 0
    plain = client.completions.create(model=tiny_model, prompt=prompt, max_tokens=0, echo=True)
    assert plain.choices[0].text == prompt and plain.choices[0].logprobs is None


# bad inputs


BAD_REQUESTS = [
    ("negative max_tokens", "/v1/completions", {"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens"),
    ("zero max_tokens", "/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("zero max_tokens in chat", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ("negative temperature", "/v1/completions", {"prompt": "Hi", "temperature": -0.5}, 400, "temperature"),
    ("top_p zero", "/v1/chat/completions", {"messages": MESSAGES, "top_p": 0}, 400, "top_p"),
    ("top_p over one", "/v1/completions", {"prompt": "Hi", "top_p": 1.5}, 400, "top_p"),
    ("over max_model_len", "/v1/completions", {"prompt": "Hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("prompt too long", "/v1/completions", {"prompt": "Hi " * 2 * MAX_MODEL_LEN, "max_tokens": 1}, 400, "prompt"),
    ("chat over max_model_len", "/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 1000},
     400, "max_tokens"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("missing prompt", "/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("token id out of range", "/v1/completions", {"prompt": [1, 10**6]}, 400, "prompt"),
    ("unknown model", "/v1/completions", {"prompt": "Hi", "model": "no-such-model"}, 404, "model"),
    ("unknown chat model", "/v1/chat/completions", {"messages": MESSAGES, "model": "gpt-4"}, 404, "model"),
    ("bad stop type", "/v1/completions", {"prompt": "Hi", "stop": 3}, 400, "stop"),
    # as vLLM: continuing the final message and starting a new assistant turn exclude each other
    ("continue_final_message with add_generation_prompt", "/v1/chat/completions",
     {"messages": MESSAGES, "continue_final_message": True}, 400, None),
]


@pytest.mark.parametrize("path,body,status,param", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request(server, path, body, status, param):
    r = server.post(path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    assert error["param"] == param
    assert_serving(server)


def test_continue_final_message(server):
    """The assistant's partial last message is continued: no new turn is opened after it."""
    messages = [*MESSAGES, {"role": "assistant", "content": "Once upon a"}]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    r = server.post("/tokenize", body)
    assert r.status_code == 200, r.text
    opened = server.post("/tokenize", {"messages": messages}).json()["tokens"]
    assert r.json()["tokens"] != opened  # the template closes (then reopens) the turn otherwise
    r = server.post("/v1/chat/completions", {**body, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


def test_invalid_json_and_unknown_route(server, client, tiny_model):
    r = requests.post(f"{server.url}/v1/completions", data=b"{not json", headers={**server.headers,
                                                                                   "Content-Type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = requests.get(f"{server.url}/v1/nothing-here", headers=server.headers)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=tiny_model, prompt="Hi", max_tokens=-3)
    assert_serving(server)


# concurrency and freeing KV blocks


def test_64_concurrent_streams(server, reference, tiny_model):
    check_concurrent_streams(server, reference, tiny_model)


def test_sync_scheduling_server(make_server, reference, tiny_model):
    """``--no-async-scheduling`` (async scheduling is the default): the same answers, and
    aborts still free every block."""
    srv = make_server(extra_args=("--no-async-scheduling",))
    check_concurrent_streams(srv, reference, tiny_model)
    check_killed_client_frees_blocks(srv)


def check_concurrent_streams(server, reference, tiny_model):
    max_tokens = 8
    expected = {p: e["text"] for p, e in zip(PROMPTS, greedy(reference, PROMPTS, max_tokens))}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model=tiny_model, prompt=prompt, max_tokens=max_tokens,
                                                  temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    texts = asyncio.run(run_all())
    mismatches = [(p, t, expected[p]) for p, t in zip(prompts, texts) if t != expected[p]]
    assert not mismatches, mismatches[:3]
    assert_all_blocks_free(server)


CLIENT_SCRIPT = """
import sys, requests
r = requests.post(sys.argv[1] + "/v1/completions", stream=True,
                  json={"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True})
for line in r.iter_lines():
    if line:
        print("streaming", flush=True)
"""


def aborted_requests(server) -> float:
    """``atom:request_success_total{finished_reason="abort"}`` over every engine: 0 before the first abort."""
    return sum(server.per_engine("atom:request_success_total", finished_reason="abort").values())


def test_killed_client_frees_blocks(server):
    check_killed_client_frees_blocks(server)


def check_killed_client_frees_blocks(server):
    aborted = aborted_requests(server)
    proc = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, server.url], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"streaming"
        m = server.metrics()
        assert m["atom:num_requests_running"] == 1
        assert m["atom:num_free_kv_blocks"] < m["atom:num_kv_blocks"]
    finally:
        proc.kill()
        proc.wait()
    assert_all_blocks_free(server, timeout=10)
    assert aborted_requests(server) == aborted + 1  # freed by the abort, not by finishing


def test_disconnected_non_streaming_client_frees_blocks(server):
    aborted = aborted_requests(server)
    body = json.dumps({"prompt": "Hello", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", body, {**server.headers, "Content-Type": "application/json"})
        assert wait_until(lambda: server.metrics()["atom:num_requests_running"] == 1, 30)
    finally:
        conn.close()  # hang up before the answer comes
    assert_all_blocks_free(server, timeout=10)
    assert aborted_requests(server) == aborted + 1


def test_metrics_are_labelled_engine_0_without_dp(server, tiny_model):
    """As vLLM's: every metric has ``model_name`` and ``engine``, "0" for the one engine."""
    before = server.per_engine("atom:request_success_total").get("0", 0.0)
    assert_serving(server)
    samples = server.samples()
    assert {labels["engine"] for _, labels, _ in samples} == {"0"}
    assert {labels["model_name"] for _, labels, _ in samples} == {tiny_model}
    assert server.per_engine("atom:num_kv_blocks")["0"] > 0
    assert server.per_engine("atom:request_success_total") == {"0": before + 1}


# profiling


def test_profiling_endpoints(server):
    assert requests.post(f"{server.url}/stop_profile", headers=server.headers).status_code == 400  # not running
    r = requests.post(f"{server.url}/start_profile", headers=server.headers)
    assert r.status_code == 200, r.text
    assert_serving(server)
    r = requests.post(f"{server.url}/stop_profile", headers=server.headers)
    assert r.status_code == 200, r.text
    traces = glob.glob(str(server.profiler_dir / "rank_0" / "*.pt.trace.json.gz"))
    assert traces, os.listdir(server.profiler_dir)


# benchmark_serving against the live server


def test_benchmark_serving(server, tiny_model, tmp_path):
    bench = pytest.importorskip("atom.benchmarks.benchmark_serving")
    args = bench.parse_args([
        "--backend", "vllm", "--model", tiny_model, "--base-url", server.url,
        "--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "6",
        "--num-prompts", "12", "--max-concurrency", "6", "--ignore-eos", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--goodput", "ttft:60000", "tpot:60000",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json",
    ])
    bench.main(args)
    with open(tmp_path / "result.json") as f:
        result = json.load(f)
    assert result["completed"] == 12 and result["total_output_tokens"] == 12 * 6
    for key in ("request_throughput", "request_goodput", "output_throughput", "total_token_throughput", "duration"):
        assert result[key] > 0, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert f"{stat}_{metric}_ms" in result, f"{stat}_{metric}_ms"
        assert result[f"mean_{metric}_ms"] > 0
    assert_all_blocks_free(server)


# lm-eval's local-completions model against the server


GENERATE_TASK = """
task: atom_e2e_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
LOGLIKELIHOOD_TASK = """
task: atom_e2e_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
LM_EVAL_DOCS = [
    {"question": "The capital of France is", "answer": " Paris", "choices": [" Paris", " Rome"], "label": 0},
    {"question": "The capital of Italy is", "answer": " Rome", "choices": [" Paris", " Rome"], "label": 1},
    {"question": "one, two, three,", "answer": " four", "choices": [" four", " five"], "label": 0},
    {"question": "The quick brown fox jumps over the", "answer": " lazy", "choices": [" lazy", " dog"], "label": 0},
]


def lm_eval_command() -> list[str] | None:
    """``lm_eval`` from $ATOM_LM_EVAL (e.g. another venv's), PATH, or this interpreter."""
    exe = os.environ.get("ATOM_LM_EVAL") or shutil.which("lm_eval")
    if exe:
        return [exe]
    if importlib.util.find_spec("lm_eval") is not None:
        return [sys.executable, "-m", "lm_eval"]
    return None


def test_lm_eval_local_completions(server, tiny_model, tmp_path):
    cmd = lm_eval_command()
    if cmd is None:
        pytest.skip("lm-eval is not installed (pip install 'lm-eval[api]', or set ATOM_LM_EVAL)")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tasks / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in LM_EVAL_DOCS))
    (tasks / "generate.yaml").write_text(GENERATE_TASK.format(data=data))
    (tasks / "choice.yaml").write_text(LOGLIKELIHOOD_TASK.format(data=data))
    model_args = (f"model={tiny_model},base_url={server.url}/v1/completions,num_concurrent=4,max_retries=1,"
                  "tokenized_requests=False")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run([*cmd, "--model", "local-completions", "--model_args", model_args,
                          "--tasks", "atom_e2e_generate,atom_e2e_choice", "--include_path", str(tasks),
                          "--output_path", str(tmp_path / "out")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    [path] = glob.glob(str(tmp_path / "out" / "**" / "results_*.json"), recursive=True)
    with open(path) as f:
        results = json.load(f)["results"]
    assert isinstance(results["atom_e2e_generate"]["exact_match,none"], float)
    assert isinstance(results["atom_e2e_choice"]["acc,none"], float)
    assert_all_blocks_free(server)


# offline profiling script


def test_profile_offline(tiny_model, tmp_path):
    from atom.examples.profile_offline import main

    traces = main(["--model", tiny_model, "--dtype", "float32", "--device", "cpu", "--max-model-len", "256",
                   "--kv-cache-memory-bytes", str(16 << 20), "--torch-profiler-dir", str(tmp_path),
                   "--input-length", "16", "--output-length", "2", "--bs", "2"])
    assert traces and all(t.startswith(str(tmp_path / "rank_0")) and t.endswith(".pt.trace.json.gz")
                          for t in traces)


# process lifecycle (servers of their own: these tests end them)


@pytest.mark.parametrize("to_group", [False, True], ids=["process", "group"])
def test_sigterm_finishes_in_flight_and_leaves_no_orphans(make_server, to_group):
    """SIGTERM to the API process, or to its whole process group (systemd's default KillMode,
    ``timeout``, ``kill -- -PGID``: the engine core gets it too and leaves the shutdown to the API
    process, which drains first)."""
    srv = make_server(own_group=to_group)
    children = srv.descendants()
    assert any("spawn_main" in " ".join(p.cmdline()) for p in children)
    result = {}

    started = threading.Event()

    def stream():
        r = srv.post("/v1/completions", {"prompt": "Hello", "max_tokens": 24, "ignore_eos": True, "stream": True},
                     stream=True)
        events = []
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                started.set()  # in flight: its first tokens have arrived
        result["events"] = events

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    if to_group:
        os.killpg(srv.proc.pid, signal.SIGTERM)
    else:
        srv.proc.send_signal(signal.SIGTERM)
    t.join(60)
    events = result["events"]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"  # finished, not cut off
    assert srv.proc.wait(60) == 0
    assert wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children), 10)


def test_api_key_then_engine_death(make_server):
    """A server with --api-key enforces it; then its engine process dies: /health says 503
    and requests fail at once instead of hanging."""
    srv = make_server(api_key=API_KEY)
    body = {"prompt": "Hello", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = requests.post(f"{srv.url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(f"{srv.url}/v1/models").status_code == 401
    assert requests.post(f"{srv.url}/start_profile").status_code == 401
    assert requests.get(f"{srv.url}/health").status_code == 200  # probes and scrapers need no key
    assert requests.get(f"{srv.url}/metrics").status_code == 200
    assert srv.post("/v1/completions", body).status_code == 200

    in_flight = {}

    def long_request():
        start = time.monotonic()
        r = srv.post("/v1/completions", {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True})
        in_flight.update(status=r.status_code, seconds=time.monotonic() - start)

    t = threading.Thread(target=long_request)
    t.start()
    assert wait_until(lambda: srv.metrics()["atom:num_requests_running"] == 1, timeout=30)
    killed = time.monotonic()
    srv.engine_core().send_signal(signal.SIGKILL)
    t.join(30)
    assert in_flight["status"] == 503
    assert time.monotonic() - killed < 5  # the pending request failed fast
    assert wait_until(lambda: requests.get(f"{srv.url}/health").status_code == 503, timeout=10)
    health = requests.get(f"{srv.url}/health").json()["error"]
    assert health["code"] == "engine_dead" and "exited" in health["message"]
    assert "\n" not in health["message"] and "Traceback" not in health["message"]  # one line; the log has more
    start = time.monotonic()
    r = srv.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert time.monotonic() - start < 5
    assert srv.stop() == 0
