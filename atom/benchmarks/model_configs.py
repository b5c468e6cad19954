"""Real model shapes for benchmarks with random weights: a directory holding only the
Hugging Face ``config.json`` (no weights, no tokenizer; use ``load_dummy``); and the command line
shared by the offline benchmarks (throughput, latency)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile

_QWEN3 = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    attention_bias=False,
    hidden_act="silu",
    torch_dtype="bfloat16",
    bos_token_id=151643,
    eos_token_id=151645,
)

CONFIGS = {
    "qwen3-0.6b": dict(
        _QWEN3,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        _QWEN3,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": dict(
        _QWEN3,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    ),
    "llama-3-8b": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
}


def model_dir(name_or_path: str) -> str:
    """A path as is; a known shape name -> a directory with its config.json."""
    if name_or_path not in CONFIGS:
        return name_or_path
    path = os.path.join(tempfile.gettempdir(), "atom-shapes", name_or_path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIGS[name_or_path], f, indent=1)
    return path


def weight_bytes(name: str, dtype_bytes: int = 2) -> int:
    """Bytes of weights a dense decode step reads: every layer plus the LM head (the
    embedding lookup reads one row only)."""
    c = CONFIGS[name]
    h, layers, v = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    hd = c["head_dim"] if "head_dim" in c else h // c["num_attention_heads"]
    attn = h * hd * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2)
    mlp = 3 * h * c["intermediate_size"]
    return (layers * (attn + mlp) + v * h) * dtype_bytes


def parse_offline_args(doc: str, argv: list[str] | None, default_model: str, arguments: list) -> argparse.Namespace:
    """The flags both offline benchmarks take, then ``arguments`` ((flags, kwargs) pairs)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model, help=f"a model dir or one of {', '.join(CONFIGS)}")
    p.add_argument("--engine", choices=["atom", "vllm"], default="atom")
    for flags, kwargs in arguments:
        p.add_argument(*flags, **kwargs)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def report(table: str, result: dict, output_json: str | None) -> dict:
    """Print the markdown table and write ``result`` to ``output_json`` when given."""
    print(table)
    if output_json:
        with open(output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result
