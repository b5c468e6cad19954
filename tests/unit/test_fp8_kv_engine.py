"""``kv_cache_dtype="fp8"`` end to end on a tiny model (CPU, reference ops): the cache is e4m3
and holds twice the tokens of the same memory, the checkpoint's k_scale/v_scale are loaded,
and greedy output agrees with the float32 cache on most tokens."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom import LLMEngine, SamplingParams
from atom.testing.agreement import teacher_forced_agreement

PROMPTS = ["The quick brown fox", "Once upon a time, a small model learned to count: one, two,",
           "def add(a, b):", "Paged attention stores keys and values in"]
MAX_TOKENS = 16


def agreement(reference: LLMEngine, candidate: LLMEngine) -> float:
    """Teacher-forced top-1 agreement on the positions the reference is clear about (top-1
    ahead of the second by 0.5 in logprob): e4m3 keeps ~2 significant digits and the tiny
    random model's attention is sharp, so near-ties flip (at margin 0.1 about 90% agree)."""
    fraction, positions = teacher_forced_agreement(reference, candidate, PROMPTS, MAX_TOKENS, min_margin=0.5)
    assert positions >= 30
    return fraction


def test_fp8_kv_cache_engine(tiny_model):
    path = tiny_model("qwen3")
    block_bytes = 2 * 3 * 2 * 16 * 24 * 4  # K and V, 3 layers, 2 KV heads, 16 tokens, head_dim 24, float32
    memory = 100 * block_bytes
    ref_engine = LLMEngine(path, max_model_len=256, kv_cache_memory_bytes=memory)
    assert ref_engine.core.block_manager.num_blocks == 100
    engine = LLMEngine(path, max_model_len=256, kv_cache_memory_bytes=memory, kv_cache_dtype="fp8")
    assert engine.core.runner.kv_cache.dtype == torch.float8_e4m3fn
    # float32 model on the CPU: an e4m3 cache holds four times the tokens of a float32 one
    assert engine.core.block_manager.num_blocks == 4 * ref_engine.core.block_manager.num_blocks
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                          use_tqdm=False)
    assert all(len(o["token_ids"]) == MAX_TOKENS for o in out)
    assert agreement(ref_engine, engine) >= 0.95


def _with_kv_scales(src: str, dst: str, k_scale: float, v_scale: float) -> str:
    shutil.copytree(src, dst)
    weights_file = os.path.join(dst, "model.safetensors")
    tensors = load_file(weights_file)
    with open(os.path.join(dst, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(k_scale)
        tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(v_scale)
    save_file(tensors, weights_file, metadata={"format": "pt"})
    return dst


def test_fp8_kv_scales_from_checkpoint(tiny_model, tmp_path):
    path = _with_kv_scales(tiny_model("qwen3"), str(tmp_path / "scaled"), 0.0625, 0.125)
    engine = LLMEngine(path, max_model_len=256, kv_cache_dtype="fp8_e4m3")
    runner = engine.core.runner
    assert [(a.k_scale.item(), a.v_scale.item()) for a in runner.attn_layers] == [(0.0625, 0.125)] * 3
    assert agreement(LLMEngine(tiny_model("qwen3"), max_model_len=256), engine) >= 0.95
    # the cache holds keys divided by the scale: never past e4m3's range, and in use
    cache = runner.kv_cache.float()
    assert cache.abs().max() <= 448 and cache.abs().max() > 0


def test_bad_kv_scale_is_refused(tiny_model, tmp_path):
    path = _with_kv_scales(tiny_model("qwen3"), str(tmp_path / "bad"), -1.0, 0.5)
    with pytest.raises(ValueError, match="KV cache scale"):
        LLMEngine(path, max_model_len=256, kv_cache_dtype="fp8")
