"""What the offline benchmarks (throughput, latency) share: real model shapes with random weights (a
directory holding only the Hugging Face ``config.json``), the command line, atom's or vLLM's engine on
token-id prompts, the device's copy bandwidth and the report."""

from __future__ import annotations

import argparse
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
_LLAMA3 = dict(_COMMON, model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, rms_norm_eps=1e-5)
_LLAMA3.update(max_position_embeddings=8192, rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001)
CONFIGS = {
    "qwen3-0.6b": {**_QWEN3, **dict(zip(_SHAPE, (1024, 3072, 28, 16, 8))), "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, **dict(zip(_SHAPE, (4096, 12288, 36, 32, 8)))},
    "qwen3-30b-a3b": {**_QWEN3, **dict(zip(_SHAPE, (2048, 6144, 48, 32, 4))), **_MOE},
    "llama-3-8b": {**_LLAMA3, **dict(zip(_SHAPE, (4096, 14336, 32, 32, 8)))},
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


def weight_bytes(name: str, dtype_bytes: int = 2) -> int:
    """Bytes of weights a dense decode step reads: every layer and the LM head (the embedding lookup
    reads one row only)."""
    c = CONFIGS[name]
    h, heads, kv_heads = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    attn = h * c.get("head_dim", h // heads) * (heads + kv_heads) * 2
    return (c["num_hidden_layers"] * (attn + 3 * h * c["intermediate_size"]) + c["vocab_size"] * h) * dtype_bytes


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
    return p.parse_args(argv)


class Engine:
    """atom's ``LLMEngine`` or vLLM's ``LLM`` with random weights of ``args.model``'s shape, on token-id prompts."""

    def __init__(self, args: argparse.Namespace, **kwargs) -> None:
        self.vllm, path = args.engine == "vllm", model_dir(args.model)
        kwargs.update(skip_tokenizer_init=True, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager)
        kwargs.update(tensor_parallel_size=args.tensor_parallel_size)
        kwargs.update(enable_expert_parallel=args.enable_expert_parallel)
        kwargs.update(disable_custom_all_reduce=args.disable_custom_all_reduce)
        kwargs.update(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
        if self.vllm:
            from vllm import LLM, SamplingParams

            self.llm, self.params = LLM(path, load_format="dummy", **kwargs), partial(SamplingParams, detokenize=False)
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
