"""Greedy output of LLMEngine is token-identical to transformers' generate (float32, CPU),
also with prefix caching, chunked prefill and preemption forced; each with and without
async scheduling."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from atom import LLMEngine, SamplingParams

ARCHS = ["qwen3", "llama", "qwen3_moe", "deepseek_v3", "deepseek_v2", "qwen2", "mistral"]
MAX_TOKENS = 20
SHARED = "Prefix caching reuses the KV cache of a shared system prompt across requests. " * 4
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, a small model learned to count: one, two, three, four, five. " * 5,
    "机器学习 🙂",
    "def add(a, b):",
    "Paged attention stores keys and values in fixed-size blocks of GPU memory. " * 2,
]


def hf_greedy(path: str, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def atom_greedy(engine: LLMEngine, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [o["token_ids"] for o in outs]


@pytest.fixture(scope="module", params=ARCHS)
def arch_ref(request, tiny_model):
    path = tiny_model(request.param)
    return path, hf_greedy(path, PROMPTS), hf_greedy(path, [SHARED + "one", SHARED + "two, three", SHARED])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_batch_matches_hf(arch_ref, async_scheduling):
    path, ref, _ = arch_ref
    engine = LLMEngine(path, max_model_len=512, async_scheduling=async_scheduling)
    assert atom_greedy(engine, PROMPTS) == ref


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefix_caching_matches_hf_and_hits(arch_ref, async_scheduling):
    path, _, shared_ref = arch_ref
    engine = LLMEngine(path, max_model_len=512, enable_prefix_caching=True, async_scheduling=async_scheduling)
    prompts = [SHARED + "one", SHARED + "two, three", SHARED]
    assert atom_greedy(engine, prompts[:1]) == shared_ref[:1]  # fills the cache
    hits_before = engine.core.block_manager.num_prefix_hits
    assert atom_greedy(engine, prompts) == shared_ref
    assert engine.core.block_manager.num_prefix_hits - hits_before >= 3 * 16  # several full blocks reused


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_matches_hf(arch_ref, async_scheduling):
    path, ref, _ = arch_ref
    engine = LLMEngine(path, max_model_len=512, max_num_batched_tokens=24, async_scheduling=async_scheduling)
    longest = max(len(engine.tokenize(p)[1]) for p in PROMPTS)
    assert longest > 24  # the long prompts really are split into chunks
    assert atom_greedy(engine, PROMPTS) == ref


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_matches_hf(arch_ref, async_scheduling):
    path, ref, _ = arch_ref
    tok = AutoTokenizer.from_pretrained(path)
    longest = max(len(tok(p).input_ids) for p in PROMPTS) + MAX_TOKENS
    # room for the longest sequence, not for all five at once
    num_blocks = -(-longest // 16) + 2
    engine = LLMEngine(path, max_model_len=512, num_gpu_blocks_override=num_blocks,
                       async_scheduling=async_scheduling)
    assert atom_greedy(engine, PROMPTS) == ref
    assert engine.core.scheduler.num_preemptions > 0
    assert engine.core.block_manager.num_free_blocks == num_blocks
