"""Speculative decoding end to end on tiny checkpoints (CPU, float32): greedy output is
token-identical to decoding without drafts, whatever the draft proposes: the shared-weights
test mode (drafts all accepted) and a random MTP layer (drafts nearly all rejected)."""

import pytest

from atom import LLMEngine, SamplingParams
from atom.testing.tiny_checkpoint import add_mtp_layer, build

# prompts of several lengths (token ids), so that chunked prefill splits some of them
PROMPTS = [list(range(10, 15)), list(range(40, 49)), list(range(100, 131)), [7, 300, 12, 55, 9, 81, 23]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
ENGINE = dict(max_num_seqs=4, kv_cache_memory_bytes=1 << 22)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """A tiny Llama checkpoint with one random MTP layer."""
    return add_mtp_layer(build(str(tmp_path_factory.mktemp("tiny-llama-mtp")), "llama"))


@pytest.fixture(scope="module")
def reference(mtp_model):
    """Outputs of the same checkpoint decoded without drafts, keyed by (prompt, params)."""
    engine = LLMEngine(mtp_model, **ENGINE)
    cache = {}

    def get(prompts, params):
        key = (repr(prompts), repr(params))
        if key not in cache:
            cache[key] = engine.generate(prompts, params, use_tqdm=False)
        return cache[key]

    return get


def token_ids(outputs):
    return [o["token_ids"] for o in outputs]


def spec_engine(path, method, k, **kwargs):
    return LLMEngine(path, method=method, num_speculative_tokens=k, **(ENGINE | kwargs))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_shared_weights_greedy_matches_and_accepts_nearly_all(mtp_model, reference, k):
    engine = spec_engine(mtp_model, "shared_weights", k)
    assert token_ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == token_ids(reference(PROMPTS, GREEDY))
    stats = engine.core.stats().spec
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.9
    assert stats.mean_accepted_length > 1 + 0.9 * k * 0.8  # (the last steps of a request verify fewer drafts)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_greedy_matches_with_chunked_prefill(mtp_model, reference, k):
    # a 16-token budget splits the long prompt into chunks and caps the drafts of full steps
    engine = spec_engine(mtp_model, "mtp", k, max_num_batched_tokens=16)
    assert token_ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == token_ids(reference(PROMPTS, GREEDY))
    stats = engine.core.stats().spec
    assert stats.num_drafts > 0 and len(stats.accepted_per_position) == k


def test_prefix_caching(mtp_model, reference):
    shared = list(range(200, 236))
    prompts = [shared + [5, 6], shared + [7], shared + [8, 9, 10]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = token_ids(reference(prompts, params))
    for method in ("mtp", "shared_weights"):
        engine = spec_engine(mtp_model, method, 2, enable_prefix_caching=True)
        assert token_ids(engine.generate(prompts[:1], params, use_tqdm=False)) == expected[:1]
        assert token_ids(engine.generate(prompts, params, use_tqdm=False)) == expected
        assert engine.core.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("method", ["shared_weights", "mtp"])
def test_preemption_in_a_tiny_kv_pool(mtp_model, reference, method):
    engine = spec_engine(mtp_model, method, 3, block_size=4, num_gpu_blocks_override=22)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert token_ids(engine.generate(PROMPTS, params, use_tqdm=False)) == token_ids(reference(PROMPTS, params))
    assert engine.core.stats().num_preemptions > 0


def test_batch_mixing_finished_and_running_requests(mtp_model, reference):
    """Different max_tokens, EOS and a stop token id inside an accepted run: requests finish
    mid-run while the others go on."""
    plain = reference(PROMPTS[:1], GREEDY)[0]["token_ids"]
    stop_id = plain[6]  # the 7th output token of the first prompt, reached inside a run of drafts
    params = [
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=17, stop_token_ids=[stop_id], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=25),
    ]
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    expected = reference(prompts, params)
    for method in ("shared_weights", "mtp"):
        out = spec_engine(mtp_model, method, 3).generate(prompts, params, use_tqdm=False)
        assert token_ids(out) == token_ids(expected)
        assert [o["finish_reason"] for o in out] == [o["finish_reason"] for o in expected]
    assert expected[1]["token_ids"][-1] == stop_id and len(expected[1]["token_ids"]) < 17


def test_stop_string_inside_an_accepted_run(mtp_model, reference):
    text = reference(PROMPTS[:1], GREEDY)[0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    expected = reference(PROMPTS[:1], params)[0]
    out = spec_engine(mtp_model, "shared_weights", 3).generate(PROMPTS[:1], params, use_tqdm=False)[0]
    assert (out["text"], out["token_ids"], out["finish_reason"]) == (
        expected["text"],
        expected["token_ids"],
        expected["finish_reason"],
    )
    assert expected["finish_reason"] == "stop" and len(expected["token_ids"]) < 20


def test_mtp_drafts_from_incremental_kv_equal_drafts_from_one_prefill(mtp_model):
    """The draft's KV cache, written chunk by chunk and step by step (rolled back over
    rejected drafts), gives the same drafts as one prefill over the same tokens."""
    engine = spec_engine(mtp_model, "mtp", 1, max_num_batched_tokens=8)
    engine.add_request([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), request_ids=["a"])
    seen = []
    while not engine.is_finished():
        engine.step()
        seq = engine.core.requests.get("a")
        if seq is not None and seq.spec_token_ids:
            seen.append((list(seq.token_ids), seq.spec_token_ids[0]))
    assert len(seen) >= 5
    for i, (tokens, draft) in enumerate(seen):
        engine.add_request(
            [tokens[:-1]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), request_ids=[f"fresh{i}"]
        )
        fresh = engine.core.requests[f"fresh{i}"]
        while fresh.num_output_tokens == 0:  # the prefill (in chunks) samples tokens[-1] and drafts
            engine.step()
        assert fresh.token_ids == tokens and fresh.spec_token_ids == [draft]
        engine.abort_request(f"fresh{i}")


def test_seeded_sampling_repeats_and_stats_print(mtp_model, capsys):
    engine = spec_engine(mtp_model, "shared_weights", 2)
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=12, seed=7, ignore_eos=True)
    first, second = (token_ids(engine.generate(PROMPTS[:2], params, use_tqdm=False)) for _ in range(2))
    assert first == second and all(len(t) == 12 for t in first)
    engine.print_mtp_statistics()
    printed = capsys.readouterr().out
    assert "Total draft tokens:" in printed and "Acceptance rate by position: [" in printed
    assert "Mean accepted length:" in printed


def test_requests_with_logprobs_decode_without_drafts(mtp_model, reference):
    engine = spec_engine(mtp_model, "shared_weights", 2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    out = engine.generate(PROMPTS[:2], params, use_tqdm=False)
    assert token_ids(out) == token_ids(reference(PROMPTS[:2], params))
    assert engine.core.stats().spec.num_draft_tokens == 0


def test_configuration(tiny_model, mtp_model):
    with pytest.raises(ValueError, match="no num_nextn_predict_layers.*shared_weights"):
        LLMEngine(tiny_model("qwen3"), method="mtp")
    engine = LLMEngine(mtp_model, speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **ENGINE)
    assert engine.config.speculative_config.num_speculative_tokens == 3
    with pytest.raises(ValueError, match="not supported: \\['draft_model'\\]"):
        LLMEngine(mtp_model, speculative_config={"method": "mtp", "draft_model": "x"})
    with pytest.raises(ValueError, match="method must be"):
        LLMEngine(mtp_model, method="eagle")
    plain = LLMEngine(mtp_model, **ENGINE)
    assert plain.core.stats().spec is None  # the MTP layer is the draft's: the target loads without it


def test_deepseek_v3_mtp_layer_drafts(tmp_path_factory):
    """The checkpoint's own DeepSeek MTP layer (MLA attention, its own latent cache) as the
    draft, and the shared-weights mode over MLA: greedy output unchanged."""
    path = build(str(tmp_path_factory.mktemp("tiny-deepseek-v3")), "deepseek_v3")
    expected = token_ids(LLMEngine(path, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False))
    for method in ("mtp", "shared_weights"):
        engine = spec_engine(path, method, 2, max_num_batched_tokens=16)
        assert token_ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected, method
        assert engine.core.stats().spec.num_draft_tokens > 0


def test_tensor_parallel_ranks_verify_and_propose_alike(mtp_model, reference):
    """-tp 2: each rank verifies and proposes with its shard of the target and of the MTP
    layer, the same seeds and the full logits; greedy output equals one rank's without drafts,
    and the shared-weights drafts are all accepted as on one rank."""
    expected = token_ids(reference(PROMPTS, GREEDY))
    for method in ("shared_weights", "mtp"):
        engine = spec_engine(mtp_model, method, 2, tensor_parallel_size=2, max_num_batched_tokens=16)
        assert token_ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected, method
        spec = engine.core.stats().spec
        assert spec.num_draft_tokens > 0
        if method == "shared_weights":
            assert spec.num_accepted_tokens == spec.num_draft_tokens


def test_rows_metadata_gives_each_token_a_decode_row():
    """The draft's rows of a verify step: every token its own decode row over its causal
    prefix, in its sequence's block table; a position past the allocated slots is clamped to
    the last one and writes no KV. Without ``decode_rows``: one query per row."""
    from types import SimpleNamespace

    import torch

    from atom.spec_decode.proposer import rows_metadata

    reqs = [SimpleNamespace(block_table=[7, 3]), SimpleNamespace(block_table=[5])]  # block size 4
    pos, meta = rows_metadata(reqs, [5, 2], [3, 3], 4, 100, torch.device("cpu"), decode_rows=True)
    assert pos.tolist() == [5, 6, 7, 2, 3, 3]  # the second row's third token is past its 4 slots
    slots = [3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 5 * 4 + 2, 5 * 4 + 3, -1]
    assert meta.slot_mapping.tolist() == slots
    assert meta.seq_lens.tolist() == [6, 7, 8, 3, 4, 4]
    assert meta.cu_seqlens_q.tolist() == list(range(7))
    assert meta.block_tables.tolist() == [[7, 3]] * 3 + [[5, 0]] * 3
    assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.num_decode_tokens) == (1, 8, 6)
    # a prompt chunk the draft reads stays one query a row (its keys read once, by the prefill path)
    pos, meta = rows_metadata(reqs, [5, 2], [3, 3], 4, 100, torch.device("cpu"))
    assert (pos.tolist(), meta.slot_mapping.tolist()) == ([5, 6, 7, 2, 3, 3], slots)
    assert (meta.cu_seqlens_q.tolist(), meta.seq_lens.tolist()) == ([0, 3, 6], [8, 4])
    assert meta.block_tables.tolist() == [[7, 3], [5, 0]]
    assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.num_decode_tokens) == (3, 8, 0)


def test_structured_output_requests_decode_without_drafts(mtp_model, reference):
    # a grammar masks one sampled position a step (its state does not cover the drafts), so such
    # requests decode one token at a time beside plain requests that keep their drafts
    from atom.sampling_params import StructuredOutputsParams

    engine = spec_engine(mtp_model, "shared_weights", 2)
    grammar = [SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(**fields))
               for fields in (dict(regex=r"[a-c]{3}-[0-9]{2}"), dict(choice=["alpha", "beta"]),
                              dict(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                         "required": ["n"]}))]  # fmt: skip
    out = engine.generate(PROMPTS[:3], grammar, use_tqdm=False)
    # a random model may not close the JSON object within 12 tokens, but no token breaks a grammar
    assert [o["finish_reason"] for o in out[:2]] == ["stop"] * 2 and out[2]["finish_reason"] in ("stop", "length")
    assert [o["token_ids"] for o in out] == token_ids(reference(PROMPTS[:3], grammar))
    assert engine.core.stats().spec.num_draft_tokens == 0
    plain = engine.generate(PROMPTS[3:], GREEDY, use_tqdm=False)
    assert token_ids(plain) == token_ids(reference(PROMPTS[3:], GREEDY))
    assert engine.core.stats().spec.num_draft_tokens > 0
