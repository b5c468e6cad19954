"""Build tiny Hugging Face checkpoints locally: a small config with unusual sizes, random
weights saved as safetensors, and a byte-level BPE tokenizer trained on local text with a
ChatML chat template. Nothing is downloaded.

    python -m atom.testing.tiny_checkpoint /tmp/atom-tiny --arch qwen3
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

from atom.testing.tiny_mtp import write_mtp_layers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks of GPU memory.",
    "Continuous batching lets new requests join a running batch at every step.",
    "The capital of France is Paris; the capital of Italy is Rome.",
    "Once upon a time, a small model learned to count: one, two, three, four, five.",
    "def add(a, b):\n    return a + b\n",
    "Prefix caching reuses the KV cache of a shared system prompt across requests.",
    "机器学习 模型 推理 引擎 — naïve café, emoji 🙂🚀 and ünïcödé text.",
]

ARCHS = {
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=24),
    "llama": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], head_dim=16,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                         "rope_theta": 500000.0},
        tie_word_embeddings=True,
    ),
    # q/k/v biases (random: see build), head_dim from hidden_size / heads (12)
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    # Llama's layers; a sliding window longer than any sequence (atom caps max_model_len at it)
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], head_dim=16, sliding_window=4096),
    "qwen3_moe": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=16, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=40, decoder_sparse_step=1, norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # multi-head latent attention with q_lora, yarn (mscale), interleaved rope, one dense layer
    # first, then sigmoid routing with the noaux_tc bias in 2 of 3 groups and a shared expert
    "deepseek_v3": dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], num_key_value_heads=6,
        q_lora_rank=40, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        n_routed_experts=6, num_experts_per_tok=2, n_group=3, topk_group=2, n_shared_experts=1,
        moe_intermediate_size=40, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                         "rope_theta": 10000.0},
        num_nextn_predict_layers=1,  # an MTP layer in mtp.safetensors (atom.testing.tiny_mtp)
    ),
    # no q_lora, plain rope, softmax routing over groups (group_limited_greedy), 2 shared experts
    "deepseek_v2": dict(
        model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], num_key_value_heads=6,
        q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=16, v_head_dim=20,
        n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, topk_method="group_limited_greedy",
        n_shared_experts=2, moe_intermediate_size=24, first_k_dense_replace=1, norm_topk_prob=False,
        routed_scaling_factor=1.5,
    ),
}


def train_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(out_dir: str, arch: str = "qwen3", seed: int = 0, num_layers: int = 3,
          dtype: torch.dtype = torch.float32, max_position_embeddings: int = 2048,
          head_dim: int | None = None, num_kv_heads: int = 2, initializer_range: float = 0.35,
          **config: object) -> str:
    """Write a tiny checkpoint of ``arch`` into ``out_dir`` and return the path. ``head_dim``
    overrides the architecture's (e.g. 32, a size vLLM's CPU attention supports);
    ``num_kv_heads=1`` gives fewer KV heads than two tensor-parallel ranks; a smaller
    ``initializer_range`` gives a model less sensitive to small errors (quantisation tests);
    further keywords override config fields (e.g. the sizes vLLM's CPU MoE and MLA kernels need,
    sizes that split into whole FP8 scale blocks)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    tokenizer = train_tokenizer()
    spec = dict(ARCHS[arch])
    model_type = spec.pop("model_type")
    if head_dim is not None:
        spec["head_dim"] = head_dim
    config = AutoConfig.for_model(model_type, **dict(
        vocab_size=len(tokenizer),
        hidden_size=72,
        intermediate_size=136,
        num_hidden_layers=num_layers,
        num_attention_heads=6,
        num_key_value_heads=spec.pop("num_key_value_heads", num_kv_heads),
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        # a wide init gives peaked logits, so greedy choices are well separated
        initializer_range=initializer_range,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    ) | spec | config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: zero at init
                buf.normal_(0.0, 0.3)
        for name, param in model.named_parameters():
            if name.endswith(".bias"):  # linear biases are zero at init: a bias not loaded would not show
                param.normal_(0.0, 0.3)
    model.save_pretrained(out_dir)
    write_mtp_layers(config, out_dir, seed, dtype)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     bos_token_id=None).save_pretrained(out_dir)
    with open(os.path.join(out_dir, "atom_tiny.json"), "w") as f:
        json.dump({"arch": arch, "seed": seed}, f)
    return out_dir


def add_mtp_layer(model_dir: str, seed: int = 1) -> str:
    """Give a tiny Llama/Qwen3 checkpoint one random multi-token-prediction layer in
    DeepSeek-V3's layout (``num_nextn_predict_layers``, tensors ``model.layers.{N}.*`` after
    the N decoder layers, in a file of their own), for the ``mtp`` speculative method."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    n, hidden = config.num_hidden_layers, config.hidden_size
    one_layer = AutoConfig.from_pretrained(model_dir, num_hidden_layers=1)
    torch.manual_seed(seed)
    block = AutoModelForCausalLM.from_config(one_layer, dtype=torch.float32).model.layers[0]
    tensors = {f"model.layers.{n}.{k}": v for k, v in block.state_dict().items()}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.{n}.{name}.weight"] = 1 + 0.1 * torch.randn(hidden)
    tensors[f"model.layers.{n}.eh_proj.weight"] = config.initializer_range * torch.randn(hidden, 2 * hidden)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(model_dir, "mtp.safetensors"))
    config.num_nextn_predict_layers = 1
    config.save_pretrained(model_dir)
    return model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="qwen3")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build(args.out_dir, args.arch, args.seed))


if __name__ == "__main__":
    main()
