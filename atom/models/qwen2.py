"""Qwen2 (Qwen2.5): Llama's blocks with biases on the q, k and v projections, none on o_proj."""

from transformers import PretrainedConfig

from atom.distributed.parallel_state import TPInfo
from atom.models.llama import LlamaAttention, LlamaForCausalLM


def qwen2_attention(config: PretrainedConfig, tp: TPInfo, prefix: str, qk_norm: bool) -> LlamaAttention:
    return LlamaAttention(config, tp, prefix, qk_norm, qkv_bias=True, o_bias=False)


class Qwen2ForCausalLM(LlamaForCausalLM):
    make_attn = staticmethod(qwen2_attention)
