"""atom's DeepSeek classes inside real vLLM on the GPU (vLLM 0.26.0 there): a tiny DeepSeek-V3
(q_lora, MoE with routed experts, MTP-less) and a V2-Lite-style checkpoint in bf16, served by
``vllm.LLM`` with atom's plugin at vLLM's defaults (torch.compile, FULL_AND_PIECEWISE CUDA
graphs: decode batches replay atom's MLA decode) and by atom's ``LLMEngine``, V3 with an fp8
latent cache too (``kv_cache_dtype="fp8"`` on both sides); prints how many
greedy sequences agree and where the others first differ (bf16: a few may).

    PYTHONPATH=$PWD:/tmp/atom_ep:/tmp/site python tests/gpu/plugin_mla_check.py   # entry points: docs/plugin.md
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from atom.testing.tiny_checkpoint import build  # noqa: E402

PROMPTS = [[3, 17, 29, 101, 7], [44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54], [200, 5], list(range(60, 140))]
MAX_TOKENS = 24


def run_vllm(path: str, kv_cache_dtype: str) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.3, skip_tokenizer_init=True,
              kv_cache_dtype=kv_cache_dtype)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens


def run_atom(path: str, kv_cache_dtype: str) -> list[list[int]]:
    from atom import LLMEngine, SamplingParams

    engine = LLMEngine(path, dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=1 << 28,
                       kv_cache_dtype=kv_cache_dtype)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    return [o["token_ids"] for o in outs]


def main() -> None:
    for arch, extra in (("deepseek_v3", dict(topk_method="noaux_tc")), ("deepseek_v2", {})):
        # DeepSeek's head sizes: vLLM 0.26 picks an MLA prefill backend for its layer at start-up
        # and refuses sizes FlashAttention lacks (the tiny defaults, nope 16 / v 12)
        path = build(tempfile.mkdtemp(), arch, dtype=torch.bfloat16, hidden_size=384, kv_lora_rank=512,
                     qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, **extra)
        for kv in ("auto", "fp8") if arch == "deepseek_v3" else ("auto",):
            ours, theirs = run_atom(path, kv), run_vllm(path, kv)
            same = sum(a == b for a, b in zip(ours, theirs))
            first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ours, theirs)]
            print(f"PLUGIN_MLA {arch} kv {kv}: {same}/{len(PROMPTS)} greedy sequences identical; "
                  f"first differences {first}", flush=True)


if __name__ == "__main__":
    main()
