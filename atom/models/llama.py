"""Llama (and the decoder blocks Qwen3 and Qwen3-MoE reuse)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from atom.distributed.parallel_state import SINGLE, TPInfo
from atom.layers.attention import Attention
from atom.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from atom.layers.layernorm import RMSNorm
from atom.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from atom.layers.rotary_embedding import RotaryEmbedding, share_cos_sin_caches
from atom.model_loader.weight_utils import load_weights


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TPInfo, prefix: str, qk_norm: bool = False,
                 qkv_bias: bool | None = None, o_bias: bool | None = None):
        super().__init__()
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        # Llama's attention_bias applies to all four projections; Qwen2 biases q, k and v only
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias, o_bias = bias if qkv_bias is None else qkv_bias, bias if o_bias is None else o_bias
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, num_heads, num_kv_heads, qkv_bias, tp)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size, o_bias, tp)
        self.q_size = self.qkv_proj.num_heads * self.head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * self.head_dim
        self.rotary_emb = RotaryEmbedding(config, self.head_dim, config.max_position_embeddings)
        self.attn = Attention(self.qkv_proj.num_heads, self.head_dim, self.head_dim**-0.5,
                              self.qkv_proj.num_kv_heads, prefix=f"{prefix}.attn")
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    @property
    def input_group(self) -> int:
        """The group of columns qkv_proj reads its input's FP8 codes in (0: it reads ``hidden_states`` only)."""
        return self.qkv_proj.input_group

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                x_q: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
        q, k, v = self.qkv_proj(hidden_states, x_q).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        o = self.attn(q, k, v, positions, self.rotary_emb, self.q_norm, self.k_norm)
        return self.o_proj(o)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPInfo, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp)

    @property
    def input_group(self) -> int:
        """The group of columns gate_up_proj reads its input's FP8 codes in (0: it reads ``x`` only)."""
        return self.gate_up_proj.input_group

    def forward(self, x: torch.Tensor, x_q: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x, x_q))


MlpFactory = Callable[[PretrainedConfig, TPInfo, int], nn.Module]
# (config, tp, prefix, qk_norm) -> the self-attention module
AttnFactory = Callable[[PretrainedConfig, TPInfo, str, bool], nn.Module]


def dense_mlp(config: PretrainedConfig, tp: TPInfo, layer_idx: int) -> nn.Module:
    return LlamaMLP(config.hidden_size, config.intermediate_size, tp, getattr(config, "mlp_bias", False))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TPInfo, layer_idx: int, qk_norm: bool, make_mlp: MlpFactory,
                 make_attn: AttnFactory = LlamaAttention):
        super().__init__()
        self.self_attn = make_attn(config, tp, f"model.layers.{layer_idx}.self_attn", qk_norm)
        self.mlp = make_mlp(config, tp, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.self_attn(positions, self.input_layernorm(hidden_states))
        else:
            hidden_states, residual = _call_normed(self.self_attn, self.input_layernorm, hidden_states, residual,
                                                   positions)  # fmt: skip
        return _call_normed(self.mlp, self.post_attention_layernorm, hidden_states, residual)


def _call_normed(module: nn.Module, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor, *args):
    """``(module(*args, norm(x + residual)), x + residual)``; where ``module`` reads its input's FP8 codes
    (an ``input_group``: LlamaAttention's qkv_proj, LlamaMLP's gate_up_proj with block scales), the norm writes
    them in its launch and the module is given them: its GEMM does not quantise its input itself."""
    group = getattr(module, "input_group", 0)
    if group:
        normed, summed, x_q = norm(x, residual, group)
        return module(*args, normed, x_q), summed
    normed, summed = norm(x, residual)
    return module(*args, normed), summed


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TPInfo, qk_norm: bool, make_mlp: MlpFactory,
                 make_attn: AttnFactory = LlamaAttention):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, tp, i, qk_norm, make_mlp, make_attn) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        share_cos_sin_caches(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig, tp: TPInfo = SINGLE):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, tp, self.qk_norm, self.make_mlp, self.make_attn)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    make_mlp = staticmethod(dense_mlp)
    make_attn = LlamaAttention

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def expert_mapping(self) -> list[tuple[str, str, int, str]]:
        return []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights(self, weights)
