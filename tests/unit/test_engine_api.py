"""LLMEngine's public API: outputs, streaming, stop conditions, bad input."""

import json
import os
import random
import shutil

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from atom import LLMEngine, SamplingParams
from atom.engine.output_processor import IncrementalDetokenizer, RequestState
from atom.engine.outputs import EngineCoreOutput


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(tiny_model("qwen3"), max_model_len=256, num_gpu_blocks_override=64)


def test_generate_returns_guide_fields(engine):
    out = engine.generate(["The quick brown fox", [5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=5),
                          use_tqdm=False)
    assert len(out) == 2
    for o in out:
        assert set(o) == {"text", "token_ids", "latency", "finish_reason", "num_tokens_input",
                          "num_tokens_output", "ttft", "tpot", "outputs"}
        assert o["outputs"] == [{"index": 0, **{k: v for k, v in o.items() if k != "outputs"}}]
        assert o["num_tokens_output"] == len(o["token_ids"]) == 5
        assert o["finish_reason"] == "length"
        assert 0 < o["ttft"] <= o["latency"]
    assert out[1]["num_tokens_input"] == 4


def test_stream_callback_gets_every_token_once_in_order(engine):
    seen: dict[str, list[int]] = {}
    texts: dict[str, str] = {}

    def callback(out):
        seen.setdefault(out.request_id, []).extend(out.new_token_ids)
        texts[out.request_id] = texts.get(out.request_id, "") + out.delta_text

    ids = engine.add_request(["Once upon a time", "def add(a, b):"], SamplingParams(temperature=0.7, max_tokens=12),
                             stream_callback=callback)
    finished = {}
    while not engine.is_finished():
        for out in engine.step():
            finished[out.request_id] = out
    for rid in ids:
        assert seen[rid] == finished[rid].token_ids
        assert texts[rid] == finished[rid].text


def test_stop_string_spanning_tokens_is_cut(engine):
    full = engine.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    text = full["text"]
    stop = text[5:9]  # four characters, likely spanning tokens
    assert len(stop) == 4
    out = engine.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
                          use_tqdm=False)[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == text[: text.find(stop)]
    assert stop not in out["text"]


def test_min_tokens_holds_back_stop_strings(engine):
    """As vLLM: a stop string that ends within the first min_tokens tokens' text does not stop."""
    prompt, params = "The quick brown fox", dict(temperature=0, max_tokens=20)
    full = engine.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]
    text, ids = full["text"], full["token_ids"]
    # the most tokens whose text is whole characters (byte tokens of a character are held back)
    k = max(k for k in range(3, 8) if "\ufffd" not in engine.tokenizer.decode(ids[:k]))
    early = engine.tokenizer.decode(ids[:k])
    stop = early[-3:]  # ends with the k-th token's text
    assert text.startswith(early) and len(stop) == 3
    first = text.find(stop)
    plain = engine.generate([prompt], SamplingParams(**params, stop=[stop]), use_tqdm=False)[0]
    assert plain["text"] == text[:first]  # without min_tokens: the first occurrence
    out = engine.generate([prompt], SamplingParams(**params, stop=[stop], min_tokens=k), use_tqdm=False)[0]
    later = text.find(stop, len(early) - len(stop) + 1)  # the first one that ends after the k-th token
    assert out["text"] == (text if later == -1 else text[:later]) != plain["text"]
    assert out["finish_reason"] == ("length" if later == -1 else "stop")


def test_stop_token_ids_and_eos(engine):
    full = engine.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    stop_tok = full["token_ids"][3]
    out = engine.generate(["The quick brown fox"],
                          SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    assert out["finish_reason"] == "stop"
    assert out["token_ids"] == full["token_ids"][: full["token_ids"].index(stop_tok) + 1]


@pytest.mark.parametrize("include", [False, True])
def test_eos_text_left_out_with_special_tokens_shown(tiny_model, include):
    """As vLLM: a request the core stopped on EOS (or a stop token id) leaves that token's text
    out, also with skip_special_tokens=False, unless include_stop_str_in_output; its id stays."""
    tok = AutoTokenizer.from_pretrained(tiny_model("qwen3"))
    ids = tok.encode(" Paris")
    params = SamplingParams(max_tokens=8, skip_special_tokens=False, include_stop_str_in_output=include)
    state = RequestState("r", None, tok.encode("The capital of France is"), params, tok)
    out, _ = state.update(EngineCoreOutput("r", [*ids, tok.eos_token_id], finish_reason="stop"))
    assert out.token_ids == [*ids, tok.eos_token_id] and out.stop_reason is None
    assert out.text == (" Paris" + tok.eos_token if include else " Paris")


def detokenizer(tok, prompt: list[int], stream: bool, **kwargs) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tok, prompt, **kwargs)
    assert (detok.stream is not None) == tok.is_fast  # a fast tokenizer streams natively
    if not stream:
        detok.stream = None  # the Python window scheme, as for a slow tokenizer
    return detok


@pytest.mark.parametrize("stream", [True, False])
def test_incremental_detokenizer_multibyte(tiny_model, stream):
    tok = AutoTokenizer.from_pretrained(tiny_model("qwen3"))
    text = "机器学习 🙂🚀 naïve café"
    ids = tok.encode(text)
    detok = detokenizer(tok, [], stream)
    pieces = [detok.add([t]) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_detokenization_equals_the_window_scheme(tiny_model, skip_special_tokens):
    tok = AutoTokenizer.from_pretrained(tiny_model("qwen3"))
    prompt = tok.encode("The capital of France is")
    rng = random.Random(0)
    ids = [rng.randrange(len(tok)) for _ in range(400)]  # broken multi-byte runs and special tokens too
    ids[50:50] = tok.encode(" Paris, café 🙂")
    for step in (1, 3):  # tokens a step (more than one with speculative decoding)
        pieces = {}
        for stream in (True, False):
            detok = detokenizer(tok, prompt, stream, skip_special_tokens=skip_special_tokens)
            pieces[stream] = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]
        # one token a step: the same pieces; several: the same text (the window scheme holds a
        # whole step back when it ends inside a character, the stream only that token)
        assert pieces[True] == pieces[False] if step == 1 else "".join(pieces[True]) == "".join(pieces[False])
        assert " Paris, café 🙂" in "".join(pieces[True])


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -3), ("min_p", 2.0), ("max_tokens", 0),
    ("stop", [""]), ("stop_token_ids", [-1]), ("n", 0),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bad_prompts_fail_alone(engine):
    rid = engine.add_request(["Once upon a time"], SamplingParams(temperature=0, max_tokens=8))[0]
    with pytest.raises(ValueError, match="300 tokens exceeds the limit of 256"):
        engine.add_request([[1] * 300])
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([""])
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([[]])
    done = []
    while not engine.is_finished():
        done += engine.step()
    assert [o.request_id for o in done] == [rid] and len(done[0].token_ids) == 8


def test_max_tokens_none_fills_the_context(engine):
    """vLLM's max_tokens=None: as many tokens as each prompt's context leaves (max_model_len 256),
    also for params shared by prompts of different lengths; the params object is left as given."""
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    prompts = [[5] * 200, [7] * 230]
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [56, 26] and {o["finish_reason"] for o in outs} == {"length"}
    assert params.max_tokens is None
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_vllm_prompt_dicts(engine):
    """vLLM's TextPrompt and TokensPrompt dicts, alone or in a list, give what their text or ids give."""
    params = SamplingParams(temperature=0, max_tokens=4)
    text, ids = "The quick brown fox", engine.tokenizer.encode("Once upon a time")
    plain = engine.generate([text, ids], params, use_tqdm=False)
    dicts = engine.generate([{"prompt": text}, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert [o["token_ids"] for o in dicts] == [o["token_ids"] for o in plain]
    assert engine.generate({"prompt": text}, params, use_tqdm=False)[0]["token_ids"] == plain[0]["token_ids"]
    with pytest.raises(ValueError, match="'prompt' \\(text\\) or 'prompt_token_ids'"):
        engine.add_request({"prompt": text, "multi_modal_data": {}})


def test_n_samples_per_prompt(engine):
    """vLLM's SamplingParams(n=N): N samples per prompt in ``outputs``, each with its index; with
    a seed, sample i is seeded seed + i: the samples differ, a rerun repeats them, and sample 0 is
    the n=1 request with that seed."""
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    outs = engine.generate(["Once upon a time", [5, 6, 7, 8]], params, use_tqdm=False)
    assert len(outs) == 2
    for o in outs:
        assert [s["index"] for s in o["outputs"]] == [0, 1, 2]
        samples = [tuple(s["token_ids"]) for s in o["outputs"]]
        assert len(set(samples)) == 3 and all(len(t) == 8 for t in samples)
        assert o["token_ids"] == o["outputs"][0]["token_ids"]  # the top-level fields are sample 0's
    again = engine.generate(["Once upon a time", [5, 6, 7, 8]], params, use_tqdm=False)
    assert [[s["token_ids"] for s in o["outputs"]] for o in again] == [[s["token_ids"] for s in o["outputs"]]
                                                                         for o in outs]
    one = engine.generate(["Once upon a time"], SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0]
    assert one["token_ids"] == outs[0]["token_ids"]
    ids = engine.add_request(["Hello"], SamplingParams(n=2, max_tokens=2), request_ids=["r"])
    assert ids == ["0_r", "1_r"]  # vLLM's child request ids
    done = []
    while not engine.is_finished():
        done += engine.step()
    assert sorted(o.request_id for o in done) == ids
    with pytest.raises(ValueError, match="seed \\+ n - 1"):
        SamplingParams(n=2, seed=2**63 - 1)


def test_chat_applies_the_chat_template(engine):
    """vLLM's LLM.chat: a conversation (or a list of them) through the tokenizer's chat template
    (no second BOS: the template holds the special tokens), then generated as generate does."""
    params = SamplingParams(temperature=0, max_tokens=6)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Paris?"}]
    tok = engine.tokenizer

    def templated(messages, **kwargs) -> list[int]:
        return tok.encode(tok.apply_chat_template(messages, tokenize=False, **kwargs), add_special_tokens=False)

    expected = engine.generate([templated(chat, add_generation_prompt=True)], params, use_tqdm=False)[0]
    [out] = engine.chat(chat, params, use_tqdm=False)
    assert out["token_ids"] == expected["token_ids"] and out["text"] == expected["text"]
    assert out["num_tokens_input"] == len(templated(chat, add_generation_prompt=True))
    other = [{"role": "user", "content": "Count to three."}]
    both = engine.chat([chat, other], params, use_tqdm=False)
    assert both[0]["token_ids"] == out["token_ids"]
    assert both[1]["token_ids"] == engine.chat(other, params, use_tqdm=False)[0]["token_ids"]
    # continue_final_message: the assistant's text is continued, no new turn opened
    partial = [*other, {"role": "assistant", "content": "One,"}]
    cont = engine.chat(partial, params, use_tqdm=False, continue_final_message=True)[0]
    assert cont["num_tokens_input"] == len(templated(partial, continue_final_message=True))
    # the caller's template, which here renders the tools too; n samples as in generate
    template = "{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{{ messages[-1]['content'] }}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    own = engine.chat(other, SamplingParams(n=2, temperature=0, max_tokens=4), use_tqdm=False,
                      chat_template=template, tools=tools)[0]
    assert own["num_tokens_input"] == len(tok.encode("get_weather;Count to three.", add_special_tokens=False))
    assert len(own["outputs"]) == 2
    with pytest.raises(ValueError, match="messages must be a non-empty list"):
        engine.chat([[]], params, use_tqdm=False)
    # OpenAI's content parts: the text parts joined by newlines (vLLM's "string" content format)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Count"}, {"type": "text", "text": "to three."}]}]
    joined = [{"role": "user", "content": "Count\nto three."}]
    rendered = engine.input_processor.apply_chat_template(parts).text
    assert rendered == tok.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)
    expected = engine.generate([templated(joined, add_generation_prompt=True)], params, use_tqdm=False)[0]
    assert engine.chat(parts, params, use_tqdm=False)[0]["token_ids"] == expected["token_ids"]
    with pytest.raises(ValueError, match="only text content parts"):
        engine.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params,
                    use_tqdm=False)  # fmt: skip


def test_prompt_larger_than_kv_cache(tiny_model):
    eng = LLMEngine(tiny_model("qwen3"), max_model_len=256, num_gpu_blocks_override=4)
    with pytest.raises(ValueError, match="100 tokens exceeds the limit of 64"):
        eng.add_request([[3] * 100])


def test_abort_frees_blocks(engine):
    free = engine.core.block_manager.num_free_blocks
    rid = engine.add_request(["Once upon a time " * 5], SamplingParams(max_tokens=50))[0]
    engine.step()
    assert engine.core.block_manager.num_free_blocks < free
    engine.abort_request(rid)
    assert engine.core.block_manager.num_free_blocks == free and engine.is_finished()


def test_missing_and_unexpected_weights_are_named(tiny_model, tmp_path):
    src = tiny_model("llama")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    weights = load_file(str(bad / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    weights["model.layers.9.extra.weight"] = weights["model.norm.weight"].clone()
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        LLMEngine(str(bad))
    assert "model.layers.1.mlp.down_proj.weight" in str(e.value)
    assert "model.layers.9.extra.weight" in str(e.value)


def test_unsupported_architecture_lists_supported(tiny_model, tmp_path):
    bad = tmp_path / "arch"
    shutil.copytree(tiny_model("llama"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    supported = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM"
    with pytest.raises(ValueError, match=supported):
        LLMEngine(str(bad))


def test_unbuilt_features_raise_not_implemented(tiny_model):
    path = tiny_model("qwen3")
    for kwargs in (dict(enable_dp_attention=True, data_parallel_size=2, method="shared_weights"),
                   dict(enable_dp_attention=True, data_parallel_size=2, tensor_parallel_size=2)):
        with pytest.raises(NotImplementedError):
            LLMEngine(path, **kwargs)


def test_dp_attention_needs_replicas_and_experts(tiny_model):
    with pytest.raises(ValueError, match="data_parallel_size >= 2"):
        LLMEngine(tiny_model("qwen3_moe"), enable_dp_attention=True)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLMEngine(tiny_model("qwen3"), enable_dp_attention=True, data_parallel_size=2)


def test_load_dummy_needs_only_config(tiny_model, tmp_path):
    only_cfg = tmp_path / "cfg"
    os.makedirs(only_cfg)
    for f in os.listdir(tiny_model("qwen3")):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_model("qwen3"), f), only_cfg)
    eng = LLMEngine(str(only_cfg), load_dummy=True, max_model_len=128)
    assert eng.generate(["hi"], SamplingParams(max_tokens=3), use_tqdm=False)[0]["num_tokens_output"] == 3


def test_request_failing_in_its_callback_fails_alone(engine):
    def explode(out):
        raise RuntimeError("callback bug")

    bad = engine.add_request(["Once upon a time"], SamplingParams(temperature=0, max_tokens=6), stream_callback=explode)
    good = engine.add_request(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=6))
    done = {}
    while not engine.is_finished():
        for out in engine.step():
            done[out.request_id] = out
    assert done[bad[0]].finish_reason == "error"
    assert done[good[0]].finish_reason == "length" and len(done[good[0]].token_ids) == 6
    assert engine.core.block_manager.num_free_blocks == engine.core.block_manager.num_blocks


def test_request_failing_in_the_core_fails_alone(engine):
    """A seed that passes SamplingParams but not torch's generator (a value a client can
    send): that request finishes with an error message, the batch it ran in goes on."""
    bad_params = SamplingParams(temperature=0.8, max_tokens=6)
    bad_params.seed = 2**64
    bad = engine.add_request(["Once upon a time"], bad_params)
    good = engine.add_request(["def add(a, b):", "The quick brown fox"], SamplingParams(temperature=0, max_tokens=6))
    done = {}
    while not engine.is_finished():
        for out in engine.step():
            done[out.request_id] = out
    assert done[bad[0]].finish_reason == "error" and "Overflow" in done[bad[0]].error
    for rid in good:
        assert done[rid].finish_reason == "length" and len(done[rid].token_ids) == 6 and done[rid].error is None
    assert engine.core.block_manager.num_free_blocks == engine.core.block_manager.num_blocks


def test_async_generate_refuses_n_samples(tiny_model):
    """AsyncLLM.generate streams one sample a request: n > 1 is refused in one line, never run as
    one sample (the server fans n out through SamplingParams.sample)."""
    import asyncio

    from atom.engine.arg_utils import EngineArgs
    from atom.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_model("qwen3"), max_model_len=128, device="cpu"))

    async def first():
        return [out async for out in engine.generate([3, 4, 5], SamplingParams(n=2, max_tokens=2), "r")]

    with pytest.raises(ValueError, match="one sample a request, got n=2"):
        asyncio.run(first())
    assert not engine.requests
