"""The server with speculative decoding (the shared-weights test mode): completions, streamed
and not, equal the plain server's greedy output, and /metrics reports the drafts."""

from __future__ import annotations

import re

import openai
import pytest
import requests
from server_process import ServerProcess

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    plain = ServerProcess(tiny_model, tmp_path_factory.mktemp("plain"))
    spec = ServerProcess(
        tiny_model,
        tmp_path_factory.mktemp("spec"),
        extra_args=("--method", "shared_weights", "--num-speculative-tokens", "2"),
    )
    yield plain, spec
    plain.stop()
    spec.stop()


def complete(server, **kwargs):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    return client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}, **kwargs
    )


def test_spec_server_matches_plain_and_reports_metrics(servers):
    plain, spec = servers
    expected = complete(plain)
    got = complete(spec)
    assert got.choices[0].text == expected.choices[0].text
    assert got.usage.completion_tokens == expected.usage.completion_tokens == 16
    streamed = "".join(chunk.choices[0].text for chunk in complete(spec, stream=True))
    assert streamed == expected.choices[0].text
    m = spec.metrics()
    assert m["atom:spec_decode_num_draft_tokens"] > 0
    assert m["atom:spec_decode_acceptance_rate"] > 0.9
    assert m["atom:spec_decode_mean_accepted_length"] > 2
    text = requests.get(f"{spec.url}/metrics", timeout=30).text
    per_pos = re.findall(r'^atom:spec_decode_num_accepted_tokens_per_pos\{.*position="(\d)".*\} (\S+)$', text, re.M)
    assert sorted(p for p, _ in per_pos) == ["0", "1"] and all(float(v) > 0 for _, v in per_pos)
    assert plain.metrics()["atom:spec_decode_num_draft_tokens"] == 0
