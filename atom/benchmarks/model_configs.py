"""What the offline benchmarks (throughput, latency) share: real model shapes with random weights (a
directory holding only the Hugging Face ``config.json``), the command line, atom's or vLLM's engine on
token-id prompts, the device's copy bandwidth and the report."""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from functools import partial

from atom.benchmarks.benchmark_utils import add_arguments, write_to_json

_SHAPE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
_COMMON = dict(hidden_act="silu", torch_dtype="bfloat16", tie_word_embeddings=False)
_QWEN3 = dict(_COMMON, model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=128, vocab_size=151936)
_QWEN3.update(max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, attention_bias=False)
_QWEN3.update(bos_token_id=151643, eos_token_id=151645)
_MOE = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], moe_intermediate_size=768, num_experts=128)
_MOE.update(num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
# Qwen's own FP8 releases (Qwen3-8B-FP8, Qwen3-30B-A3B-FP8): e4m3 weights in 128x128 blocks
_FP8_BLOCK = dict(quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                           weight_block_size=[128, 128], modules_to_not_convert=["lm_head"]))
_QWEN2 = dict(_COMMON, model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=152064, rms_norm_eps=1e-6)
_QWEN2.update(max_position_embeddings=32768, rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645)
_QWEN2.update(sliding_window=131072, use_sliding_window=False, max_window_layers=28)  # as Qwen2.5's config.json
_LLAMA3 = dict(_COMMON, model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, rms_norm_eps=1e-5)
_LLAMA3.update(max_position_embeddings=8192, rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001)
# DeepSeek's MLA + MoE models: their Hugging Face config.json fields (atom and vLLM read the same ones)
_MLA = dict(_COMMON, hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16)
_MLA.update(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
_MLA.update(moe_intermediate_size=1408, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2)
_MLA.update(first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1, attention_bias=False)
_DEEPSEEK_V2_LITE = dict(_MLA, model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"])
_DEEPSEEK_V2_LITE.update(intermediate_size=10944, topk_method="greedy", scoring_func="softmax", norm_topk_prob=False)
_DEEPSEEK_V2_LITE.update(routed_scaling_factor=1.0, vocab_size=102400, rope_theta=10000.0, rms_norm_eps=1e-6)
_DEEPSEEK_V2_LITE.update(max_position_embeddings=163840, bos_token_id=100000, eos_token_id=100001)
_DEEPSEEK_V2_LITE["rope_scaling"] = dict(type="yarn", factor=40, original_max_position_embeddings=4096, mscale=0.707,
                                         mscale_all_dim=0.707, beta_fast=32, beta_slow=1)
_MOONLIGHT = dict(_MLA, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], intermediate_size=11264)
_MOONLIGHT.update(topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.446)
_MOONLIGHT.update(vocab_size=163840, rope_theta=50000.0, rope_scaling=None, max_position_embeddings=8192)
_MOONLIGHT.update(rms_norm_eps=1e-5, bos_token_id=163584, eos_token_id=163585, num_nextn_predict_layers=0)
# DeepSeek-V3's attention (128 heads, q_lora 1536) and dense MLP in 8 layers: the whole model does not fit
# one GPU; these layers show its MLA decode on one (benchmark shape only, no such checkpoint)
_DEEPSEEK_V3_8L = dict(_MLA, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=7168)
_DEEPSEEK_V3_8L.update(num_hidden_layers=8, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536)
_DEEPSEEK_V3_8L.update(intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1)
_DEEPSEEK_V3_8L.update(num_experts_per_tok=8, first_k_dense_replace=8, n_group=8, topk_group=4, topk_method="noaux_tc")
_DEEPSEEK_V3_8L.update(scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, vocab_size=129280)
_DEEPSEEK_V3_8L.update(rope_theta=10000.0, max_position_embeddings=163840, rms_norm_eps=1e-6, bos_token_id=0)
_DEEPSEEK_V3_8L.update(eos_token_id=1, num_nextn_predict_layers=0)
_DEEPSEEK_V3_8L["rope_scaling"] = dict(type="yarn", factor=40, original_max_position_embeddings=4096, mscale=1.0,
                                      mscale_all_dim=1.0, beta_fast=32, beta_slow=1)
CONFIGS = {
    "qwen3-0.6b": {**_QWEN3, **dict(zip(_SHAPE, (1024, 3072, 28, 16, 8))), "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, **dict(zip(_SHAPE, (4096, 12288, 36, 32, 8)))},
    "qwen3-30b-a3b": {**_QWEN3, **dict(zip(_SHAPE, (2048, 6144, 48, 32, 4))), **_MOE},
    "qwen2.5-7b": {**_QWEN2, **dict(zip(_SHAPE, (3584, 18944, 28, 28, 4)))},  # Qwen/Qwen2.5-7B-Instruct
    "llama-3-8b": {**_LLAMA3, **dict(zip(_SHAPE, (4096, 14336, 32, 32, 8)))},
    "deepseek-v2-lite": _DEEPSEEK_V2_LITE,  # deepseek-ai/DeepSeek-V2-Lite
    "moonlight-16b-a3b": _MOONLIGHT,  # moonshotai/Moonlight-16B-A3B
    "deepseek-v3-8l": _DEEPSEEK_V3_8L,  # deepseek-ai/DeepSeek-V3's layers, 8 of them, all dense
}


CONFIGS["qwen3-8b-fp8"] = {**CONFIGS["qwen3-8b"], **_FP8_BLOCK}
CONFIGS["qwen3-30b-a3b-fp8"] = {**CONFIGS["qwen3-30b-a3b"], **_FP8_BLOCK}


def model_dir(name_or_path: str) -> str:
    """A path as is; a known shape name -> a directory with its config.json."""
    if name_or_path not in CONFIGS:
        return name_or_path
    os.makedirs(path := os.path.join(tempfile.gettempdir(), "atom-shapes", name_or_path), exist_ok=True)
    write_to_json(os.path.join(path, "config.json"), CONFIGS[name_or_path], indent=1)
    return path


def scaled_down(name: str, **fields) -> dict:
    """``CONFIGS[name]`` at toy sizes for the CPU (tests, ``--tiny`` runs): the same architecture,
    routing, rope and vocabulary, with a small hidden size, 3 layers and 8 experts; ``fields``
    override any of it."""
    c = dict(CONFIGS[name], hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4)
    if "kv_lora_rank" in c:
        c.update(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    else:
        c.update(num_key_value_heads=2, head_dim=16)
    if "moe_intermediate_size" in c:
        c.update(moe_intermediate_size=32, num_experts_per_tok=min(c["num_experts_per_tok"], 4))
        c["n_routed_experts" if "n_routed_experts" in c else "num_experts"] = 8
    return c | fields


def weight_bytes(c: dict, fp8: bool | None = None) -> int:
    """Bytes of weights a batch-1 decode step reads, from a config.json's fields ``c``: every layer's
    attention and MLP, of a mixture of experts only the router, the token's top-k experts and the
    shared experts, and the LM head (the embedding lookup reads one row only; norms are left out).
    FP8 (``fp8``, or by default a ``quantization_config`` in ``c``): one byte a weight for the layers'
    linears, two for the router and the LM head, which stay bf16 (block scales, 1/4,096 of the
    bytes, left out)."""
    if fp8 is None:
        fp8 = (c.get("quantization_config") or {}).get("quant_method") in ("fp8", "compressed-tensors")
    h, heads = c["hidden_size"], c["num_attention_heads"]
    if "kv_lora_rank" in c:  # DeepSeek's multi-head latent attention (atom.models.deepseek_v2)
        rank, nope, rope, v = c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        q_rank, q_out = c["q_lora_rank"], heads * (nope + rope)
        attn = (h * q_rank + q_rank * q_out if q_rank else h * q_out) + h * (rank + rope)  # q; kv_a_proj_with_mqa
        attn += rank * heads * (nope + v) + heads * v * h  # kv_b_proj, o_proj
    else:
        head_dim = c.get("head_dim", h // heads)
        attn = h * head_dim * (heads + c["num_key_value_heads"]) * 2  # q, k, v, o
    experts = c.get("num_experts") or c.get("n_routed_experts") or 0
    active = c.get("num_experts_per_tok", 0) + c.get("n_shared_experts", 0)
    moe_layers = sum(_is_moe_layer(c, i) for i in range(c["num_hidden_layers"]))
    mlps = moe_layers * 3 * h * c.get("moe_intermediate_size", 0) * active  # routed and shared experts
    mlps += (c["num_hidden_layers"] - moe_layers) * 3 * h * c["intermediate_size"]
    linears, bf16 = c["num_hidden_layers"] * attn + mlps, moe_layers * experts * h + c["vocab_size"] * h  # router, head
    return linears * (1 if fp8 else 2) + bf16 * 2


def _is_moe_layer(c: dict, i: int) -> bool:
    """As the models decide it: atom.models.deepseek_v2.is_moe_layer and qwen3_moe.moe_or_dense."""
    if c.get("n_routed_experts"):
        return i >= c["first_k_dense_replace"] and i % c["moe_layer_freq"] == 0
    return bool(c.get("num_experts")) and i not in c["mlp_only_layers"] and (i + 1) % c["decoder_sparse_step"] == 0


def hf_config(name_or_path: str) -> dict:
    """The fields of ``config.json`` of a shape name or a model directory."""
    with open(os.path.join(model_dir(name_or_path), "config.json")) as f:
        return json.load(f)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), over a copy far larger than L2."""
    import torch
    import triton

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e3


def parse_offline_args(doc: str, argv: list[str] | None, default_model: str, rows: list) -> argparse.Namespace:
    """The flags both offline benchmarks take, with ``rows`` (see ``add_arguments``) after --engine."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    head = [("--model", default_model, f"a model dir or one of {', '.join(CONFIGS)}")]
    head.append(("--engine", "atom", "the engine to measure", dict(choices=["atom", "vllm"])))
    tail = [("--max-model-len", 4096, None), ("--enforce-eager", False, None)]
    add_arguments(p, head + rows + tail + [("--output-json", str, "write the result here")])
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, help="GPUs per engine (both engines)")
    p.add_argument("--enable-expert-parallel", action="store_true", help="MoE experts sharded over the -tp ranks")
    p.add_argument("--disable-custom-all-reduce", action="store_true", help="NCCL for every all-reduce (both engines)")
    p.add_argument("--quantization", "-q", choices=["fp8"], help="quantise the weights on load (both engines)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8 or fp8_e4m3 (both engines)")
    p.add_argument("--block-size", type=int, help="KV-cache block size (default: each engine's own)")
    return p.parse_args(argv)


def redraw_dummy_weights(worker, seed: int = 0) -> int:
    """Give a vLLM worker's model the weights atom's ``load_dummy`` draws (norm weights and
    scales 1, every other floating-point weight normal(0, 0.02); FP8 and integer tensors kept
    at vLLM's draw, and MLA's absorbed copies of ``kv_b_proj`` are redrawn on their own), so
    both engines run the same weight distribution where it matters to speed: the routing.
    vLLM's own dummy weights (uniform
    +-1e-3, norm weights included) make MoE router scores tie after vLLM's bf16 softmax
    (DeepSeek-V2's grouped top-k), so every token routes to the same few experts and a decode
    step reads 6 of 64 experts where a trained checkpoint reads them all. Returns the number
    of tensors redrawn."""
    import torch

    redrawn = 0
    with torch.no_grad():
        for i, (name, param) in enumerate(worker.get_model().named_parameters()):
            if param.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                continue
            if "norm" in name or "scale" in name:
                param.fill_(1.0)
            else:
                gen = torch.Generator(device=param.device).manual_seed(seed + i)
                param.normal_(0.0, 0.02, generator=gen)
            redrawn += 1
    return redrawn


class Engine:
    """atom's ``LLMEngine`` or vLLM's ``LLM`` with random weights of ``args.model``'s shape, on token-id prompts."""

    def __init__(self, args: argparse.Namespace, **kwargs) -> None:
        self.vllm, path = args.engine == "vllm", model_dir(args.model)
        kwargs.update(skip_tokenizer_init=True, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager)
        kwargs.update(tensor_parallel_size=args.tensor_parallel_size)
        kwargs.update(enable_expert_parallel=args.enable_expert_parallel)
        kwargs.update(disable_custom_all_reduce=args.disable_custom_all_reduce)
        kwargs.update(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
        if args.block_size:
            kwargs.update(block_size=args.block_size)
        if self.vllm:
            from vllm import LLM, SamplingParams

            # the callable below travels to vLLM's engine process by pickle, which vLLM allows only when asked
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
            self.llm, self.params = LLM(path, load_format="dummy", **kwargs), partial(SamplingParams, detokenize=False)
            self.llm.collective_rpc(redraw_dummy_weights)
        else:
            from atom import LLMEngine, SamplingParams

            self.llm, self.params = LLMEngine(path, load_dummy=True, **kwargs), SamplingParams

    def generate(self, prompts: list[list[int]], params) -> list[int]:
        """Output token counts; atom's outputs also carry the engine's own TPOT (``self.tpots``)."""
        if self.vllm:
            outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [len(o.outputs[0].token_ids) for o in outs]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        self.tpots = [o["tpot"] for o in outs]
        return [o["num_tokens_output"] for o in outs]


def report(columns: dict[str, object], result: dict, output_json: str | None) -> dict:
    """Print ``columns`` as a one-row markdown table, and write ``result`` to ``output_json`` when given."""
    print(f"| {' | '.join(columns)} |\n|{'---|' * len(columns)}\n| {' | '.join(map(str, columns.values()))} |")
    if output_json:
        write_to_json(output_json, result, indent=1)
    return result
