"""``kv_cache_dtype="fp8"`` end to end on a tiny model (CPU, reference ops): the cache is e4m3
and holds twice the tokens of the same memory, the checkpoint's k_scale/v_scale are loaded,
and greedy output agrees with the float32 cache on most tokens. The same for DeepSeek's
latent (MLA) cache, with the MTP draft's own latent cache and two tensor-parallel ranks."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom import LLMEngine, SamplingParams
from atom.testing.agreement import decode_agreement, teacher_forced_agreement
from atom.testing.tiny_checkpoint import build

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


# MLA: one e4m3 latent row (kv_lora_rank + rope = 32 + 8 values) per token and layer


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_mla_fp8_kv_cache_engine(arch, tmp_path):
    """Capacity, and agreement with the float32 cache on both paths that read it: prompts
    (teacher-forced; an fp8 cache is read back by prefill too) and decode steps. The tiny
    model has a narrower init (0.2) than the shared one: at 0.35 its attention and routing are
    so sharp that the latents' e4m3 error (2.6% rms) flips 20% of even clear positions (79% /
    85% for V3 / V2 at margin 0.5; 98% / 98% at 0.2), where bf16 weights flip none."""
    path = build(str(tmp_path / arch), arch, initializer_range=0.2)
    memory = 100 * 3 * 16 * 40 * 4  # 100 blocks: 3 layers, 16 tokens, one float32 latent row each
    ref_engine = LLMEngine(path, max_model_len=256, kv_cache_memory_bytes=memory)
    assert ref_engine.core.block_manager.num_blocks == 100
    engine = LLMEngine(path, max_model_len=256, kv_cache_memory_bytes=memory, kv_cache_dtype="fp8")
    assert engine.core.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert engine.core.block_manager.num_blocks == 400  # one byte per value
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                          use_tqdm=False)
    assert all(len(o["token_ids"]) == MAX_TOKENS for o in out)
    assert agreement(ref_engine, engine) >= 0.95
    # decode steps: 89% / 96% measured over 32 tokens (a bf16-weights engine: 96% / 100%)
    fraction, positions = decode_agreement(ref_engine, engine, PROMPTS, 2 * MAX_TOKENS, min_margin=0.5)
    assert positions >= 30 and fraction >= 0.85


def _with_mla_kv_scales(src: str, dst: str, k_scale: float) -> str:
    """vLLM's name for an MLA layer's cache scale, on every layer including the MTP one."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"] + 1
    scales = {f"model.layers.{i}.self_attn.k_scale": torch.tensor(k_scale) for i in range(layers)}
    save_file(scales, os.path.join(dst, "kv_scales.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def scaled_deepseek(tiny_model, tmp_path_factory):
    """The tiny DeepSeek-V3 with k_scale 0.0625, and its greedy tokens with an fp8 cache (no drafts)."""
    path = _with_mla_kv_scales(tiny_model("deepseek_v3"), str(tmp_path_factory.mktemp("v3") / "scaled"), 0.0625)
    engine = LLMEngine(path, max_model_len=256, kv_cache_dtype="fp8")
    runner = engine.core.runner
    assert [a.k_scale.item() for a in runner.attn_layers] == [0.0625] * 3
    expected = [o["token_ids"] for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]
    # the cache holds latents divided by the scale: in e4m3's range, and in use
    assert 16 < runner.kv_cache.float().abs().max() <= 448
    return path, expected


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_mla_fp8_mtp_matches_plain_decoding(scaled_deepseek):
    """The MTP draft layer gets its own e4m3 latent cache and its checkpoint scale; greedy
    output equals decoding without drafts: verification (a prompt-like chunk) reads the same
    quantised latents as decode, as chunked prefill does."""
    path, expected = scaled_deepseek
    engine = LLMEngine(path, max_model_len=256, kv_cache_dtype="fp8", method="mtp", num_speculative_tokens=2,
                       max_num_batched_tokens=16)
    runner = engine.core.runner
    assert len(runner.attn_layers) == 4 and runner.kv_cache.dtype == torch.float8_e4m3fn
    assert [a.k_scale.item() for a in runner.attn_layers] == [0.0625] * 4
    assert [o["token_ids"] for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    assert engine.core.stats().spec.num_draft_tokens > 0


def test_mla_fp8_tp2_with_mtp_matches_one_rank(scaled_deepseek):
    path, expected = scaled_deepseek
    engine = LLMEngine(path, max_model_len=256, kv_cache_dtype="fp8", tensor_parallel_size=2, method="mtp",
                       num_speculative_tokens=2)
    try:
        assert [o["token_ids"] for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        assert engine.core.stats().spec.num_draft_tokens > 0
    finally:
        engine.shutdown()


def _declaring(path: str, scheme: dict) -> str:
    """The checkpoint at ``path`` with a quantization_config that quantises only the KV cache."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "compressed-tensors", "kv_cache_scheme": scheme}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


FP8_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def test_auto_takes_the_checkpoints_fp8_kv_cache(tiny_model, tmp_path, caplog):
    # vLLM's --kv-cache-dtype auto: an llm-compressor checkpoint that declares an fp8 KV cache
    # (bf16 / float32 weights, per-layer k_scale / v_scale) gets one, with its scales
    path = _declaring(_with_kv_scales(tiny_model("qwen3"), str(tmp_path / "kv"), 0.0625, 0.125), FP8_SCHEME)
    with caplog.at_level("INFO"):
        engine = LLMEngine(path, max_model_len=256, kv_cache_dtype="auto")
    assert "the checkpoint declares an fp8 KV cache" in caplog.text
    assert engine.core.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert [(a.k_scale.item(), a.v_scale.item()) for a in engine.core.runner.attn_layers] == [(0.0625, 0.125)] * 3
    assert agreement(LLMEngine(tiny_model("qwen3"), max_model_len=256), engine) >= 0.95
    # an explicit dtype wins, and the default is the seed guide's bf16 (the model's dtype)
    for kv_cache_dtype in ("bf16", None):
        kwargs = {"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype else {}
        assert LLMEngine(path, max_model_len=256, **kwargs).core.runner.kv_cache.dtype == torch.float32


def test_auto_keeps_the_model_dtype_for_per_head_scales(tiny_model, tmp_path, caplog):
    path = str(tmp_path / "per_head")
    shutil.copytree(tiny_model("qwen3"), path)
    _declaring(path, FP8_SCHEME | {"strategy": "attn_head"})
    from atom.engine.arg_utils import EngineArgs

    with caplog.at_level("WARNING"):
        config = EngineArgs(model=path, device="cpu", kv_cache_dtype="auto").create_engine_config()
    assert config.cache_config.kv_cache_dtype == "auto" and "attn_head scales" in caplog.text
