"""DeepSeek-V2 and DeepSeek-V3 (also R1, Kimi-K2, Moonlight): Llama's decoder blocks with
multi-head latent attention (``atom.layers.mla``) and, after the first
``first_k_dense_replace`` dense layers, a mixture of experts with shared experts and
grouped top-k routing (``ops.grouped_topk``).

Tensor parallelism splits the heads (``q_b_proj``/``q_proj``, ``kv_b_proj``, ``o_proj``) and
the experts as for the other models; the down-projections to the latent (``q_a_proj``,
``kv_a_proj_with_mqa``) are replicated, so every rank holds the whole latent cache.

The checkpoint's next-n prediction layers (``model.layers.{num_hidden_layers + i}``, the
MTP draft) are not part of this model: ``atom.models.deepseek_mtp.DeepseekMTP`` loads them.
The model's ``forward`` returns the final (normed) hidden states, the
``previous_hidden_states`` the MTP draft takes; ``compute_logits`` maps them to logits.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from atom import ops
from atom.distributed.parallel_state import SINGLE, TPInfo
from atom.layers.layernorm import RMSNorm
from atom.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from atom.layers.mla import MLAAttention
from atom.layers.moe import FusedMoE
from atom.layers.quantization.fp8_config import Fp8Config, get_fp8_config
from atom.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from atom.model_loader.weight_utils import load_weights
from atom.models.llama import LlamaForCausalLM, LlamaMLP

# the latent norms use the reference implementation's default eps, not rms_norm_eps
_LATENT_NORM_EPS = 1e-6


def softmax_scale(config: PretrainedConfig) -> float:
    """``qk_head_dim ** -0.5``, times yarn's ``mscale(factor, mscale_all_dim) ** 2`` (the
    softmax temperature correction of DeepSeek's long-context scaling)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if params["rope_type"] != "default" and mscale_all_dim and params["factor"] > 1:
        mscale = 0.1 * mscale_all_dim * math.log(params["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


class DeepseekAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TPInfo, prefix: str, qk_norm: bool = False):
        super().__init__()
        heads, hidden = config.num_attention_heads, config.hidden_size
        self.nope, self.rope, self.v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = config.kv_lora_rank, getattr(config, "q_lora_rank", None)
        bias = getattr(config, "attention_bias", False)
        qk_head = self.nope + self.rope
        latent = self.kv_lora_rank + self.rope
        self.fused = fuse_qkv_a(config)
        if self.q_lora_rank:
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_head, False, tp)
        if self.fused:  # the query's first projection and the latent one read the same input: one GEMM
            sizes = [self.q_lora_rank or heads * qk_head, latent]
            self.fused_qkv_a_proj = MergedColumnParallelLinear(hidden, sizes, False, tp,
                                                               replicated=(bool(self.q_lora_rank), True))  # fmt: skip
        else:
            if self.q_lora_rank:
                self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias)
            else:
                self.q_proj = ColumnParallelLinear(hidden, heads * qk_head, False, tp)
            self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, latent, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.nope + self.v), False, tp)
        self.kv_b_proj.dequantize_after_loading = True  # MLA multiplies by its weight directly
        self.o_proj = RowParallelLinear(heads * self.v, hidden, bias, tp)
        self.rotary_emb = RotaryEmbedding(config, self.rope, config.max_position_embeddings)
        # DeepSeek-V2 checkpoints always pair their rope dims; V3 says so in rope_interleave
        interleaved = getattr(config, "rope_interleave", True)
        self.attn = MLAAttention(heads // tp.size, self.nope, self.rope, self.v, self.kv_lora_rank,
                                 softmax_scale(config), interleaved, prefix=f"{prefix}.attn")  # fmt: skip

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.fused:
            q, latent = self.fused_qkv_a_proj(hidden_states).split(self.fused_qkv_a_proj.rank_sizes, dim=-1)
        else:
            q = self.q_a_proj(hidden_states) if self.q_lora_rank else self.q_proj(hidden_states)
            latent = self.kv_a_proj_with_mqa(hidden_states)
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q))
        kv_c, k_pe = latent.split([self.kv_lora_rank, self.rope], dim=-1)
        # kv_c not yet normed: the attention layer norms it (in decode steps inside its rope kernel)
        o = self.attn(q, kv_c, k_pe, positions, self.rotary_emb, self.kv_b_proj.weight, self.kv_a_layernorm)
        return self.o_proj(o)


class DeepseekRouter(nn.Module):
    """The gate: router logits in float32, as the reference computes them (it upcasts the
    input and the weight), and V3's ``e_score_correction_bias`` (float32 whatever the model
    dtype). On CUDA one cuBLAS GEMM takes the 16-bit input and weight and writes float32 (the
    products are exact, the sums float32: the reference's numbers without its two conversion
    kernels a step, as vLLM's ``GateLinear``); elsewhere both are upcast."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
            if correction_bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype == self.weight.dtype and x.dtype in (torch.bfloat16, torch.float16):
            return torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        return F.linear(x.float(), self.weight.float())


class DeepseekMoE(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TPInfo, topk_method: str):
        super().__init__()
        if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"unsupported topk_method {topk_method!r}")
        num_experts = config.n_routed_experts
        self.top_k, self.renormalize = config.num_experts_per_tok, bool(getattr(config, "norm_topk_prob", False))
        self.scaling = getattr(config, "routed_scaling_factor", 1.0)
        default_scoring = "sigmoid" if topk_method == "noaux_tc" else "softmax"
        self.scoring = getattr(config, "scoring_func", None) or default_scoring
        grouped = topk_method != "greedy"
        self.num_groups = (getattr(config, "n_group", None) or 1) if grouped else 1
        self.topk_groups = (getattr(config, "topk_group", None) or self.num_groups) if grouped else 1
        self.gate = DeepseekRouter(config.hidden_size, num_experts, correction_bias=topk_method == "noaux_tc")
        shared = getattr(config, "n_shared_experts", None) or 0
        self.num_fused_shared = fused_shared_experts(config, tp)
        self.experts = FusedMoE(num_experts, self.top_k, config.hidden_size, config.moe_intermediate_size,
                                self.renormalize, tp, self.num_fused_shared)  # fmt: skip
        self.shared_experts = (
            LlamaMLP(config.hidden_size, config.moe_intermediate_size * shared, tp)
            if shared and not self.num_fused_shared
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # shared experts inside the MoE launch for small batches, a dense MLP on the same weights
        # for large ones (FP8 experts: always inside)
        dense = bool(self.num_fused_shared) and x.shape[0] > FUSED_SHARED_MAX_TOKENS
        dense = dense and self.experts.quant_method is None
        weights, ids = ops.grouped_topk(self.gate(x), self.top_k, self.scoring, self.num_groups, self.topk_groups,
                                        self.gate.e_score_correction_bias, self.renormalize, self.scaling,
                                        0 if dense else self.num_fused_shared)  # fmt: skip
        out = self.experts.forward_routed(x, weights, ids, dense_shared=dense)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


# batches up to this many tokens run the shared experts inside the fused MoE launch (decode
# steps); larger ones as a dense MLP (prompt chunks: cuBLAS). Not yet swept on a GPU: the
# variable sets it for a sweep (0: always the dense MLP).
FUSED_SHARED_MAX_TOKENS = int(os.environ.get("ATOM_FUSED_SHARED_MAX_TOKENS", "256"))


def fused_shared_experts(config: PretrainedConfig, tp: TPInfo) -> int:
    """How many shared experts run inside the fused MoE (``FusedMoE``'s ``num_shared``): all of
    them (one launch instead of the shared MLP's three kernels and an add: ~16 us of a
    DeepSeek-V2-Lite layer at batch 1) where every rank holds a slice of every expert; none
    with expert parallelism or data-parallel attention (a shared expert belongs to every rank's
    tokens there), nor in an FP8 checkpoint whose shared experts cannot load as experts."""
    shared = getattr(config, "n_shared_experts", None) or 0
    if not shared or tp.expert_parallel or tp.moe is not None:
        return 0
    quant = get_fp8_config(config, None)
    return shared if quant is None or _shared_load_as_experts(config, quant) else 0


def _shared_load_as_experts(config: PretrainedConfig, quant: Fp8Config) -> bool:
    """Whether an FP8 checkpoint's shared MLP splits into expert slots: quantised wherever the
    routed experts are (the ignore list), and each slot's down projection a whole number of
    scale groups (so a group never spans two slots)."""
    if quant.group_k and config.moe_intermediate_size % quant.group_k:
        return False
    for layer in _checkpoint_layers(config):
        mlp = f"{layer}.mlp"
        experts = quant.ignores([f"{mlp}.experts"])
        if any(quant.ignores([f"{mlp}.shared_experts.{p}"]) != experts for p in ("gate_proj", "up_proj", "down_proj")):
            return False
    return True


def fuse_qkv_a(config: PretrainedConfig) -> bool:
    """Whether ``q_a_proj`` (or, without a query LoRA, ``q_proj``) and ``kv_a_proj_with_mqa`` load
    into one ``fused_qkv_a_proj`` (a launch fewer a layer; vLLM fuses the LoRA pair the same way):
    not with attention biases, nor in a quantised checkpoint whose ignore list leaves one of the
    two unquantised in some layer (a fused layer is quantised or not as a whole). FP8 scales are
    per row once loaded, so the two parts keep their own."""
    if getattr(config, "attention_bias", False):
        return False
    quant = get_fp8_config(config, None)
    if quant is None or not quant.ignore:
        return True
    query = "q_a_proj" if getattr(config, "q_lora_rank", None) else "q_proj"
    return all(quant.ignores([f"{layer}.self_attn.{query}"]) == quant.ignores([f"{layer}.self_attn.kv_a_proj_with_mqa"])
               for layer in _checkpoint_layers(config))


def _checkpoint_layers(config: PretrainedConfig) -> list[str]:
    """The checkpoint's decoder layers' module names, its MTP layers' after them."""
    layers = config.num_hidden_layers + (getattr(config, "num_nextn_predict_layers", None) or 0)
    return [f"model.layers.{i}" for i in range(layers)]


def packed_modules(config: PretrainedConfig) -> dict[str, tuple[str, int]]:
    """Checkpoint module -> (packed module, part) for DeepSeek's decoder layers."""
    packed = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    if fuse_qkv_a(config):
        query = "q_a_proj" if getattr(config, "q_lora_rank", None) else "q_proj"
        packed |= {query: ("fused_qkv_a_proj", 0), "kv_a_proj_with_mqa": ("fused_qkv_a_proj", 1)}
    return packed


def moe_expert_mapping(model: nn.Module, num_experts: int) -> list[tuple[str, str, int, str]]:
    """``FusedMoE.expert_mapping`` for the model's MoE layers (their fused shared experts too)."""
    num_shared = next((m.num_shared for m in model.modules() if isinstance(m, FusedMoE)), 0)
    return FusedMoE.expert_mapping(num_experts, num_shared=num_shared)


def is_moe_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    return bool(
        getattr(config, "n_routed_experts", None)
        and layer_idx >= (getattr(config, "first_k_dense_replace", None) or 0)
        and layer_idx % (getattr(config, "moe_layer_freq", None) or 1) == 0
    )


def deepseek_mlp(config: PretrainedConfig, tp: TPInfo, layer_idx: int, default_topk_method: str) -> nn.Module:
    """The layer's MoE block, or a dense MLP in the first ``first_k_dense_replace`` layers;
    ``topk_method`` comes from the config when it names one (real checkpoints do)."""
    if is_moe_layer(config, layer_idx):
        return DeepseekMoE(config, tp, getattr(config, "topk_method", None) or default_topk_method)
    return LlamaMLP(config.hidden_size, config.intermediate_size, tp)


def mtp_layer_index(name: str, config: PretrainedConfig) -> int | None:
    """The MTP layer (0, 1, ...) a checkpoint tensor belongs to, or None for the model's own."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m is None or int(m.group(1)) < config.num_hidden_layers:
        return None
    return int(m.group(1)) - config.num_hidden_layers


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    default_topk_method = "greedy"
    make_attn = DeepseekAttention

    def __init__(self, config: PretrainedConfig, tp: TPInfo = SINGLE):
        super().__init__(config, tp)
        self.packed_modules_mapping = packed_modules(config)

    def make_mlp(self, config: PretrainedConfig, tp: TPInfo, layer_idx: int) -> nn.Module:
        return deepseek_mlp(config, tp, layer_idx, self.default_topk_method)

    def expert_mapping(self) -> list[tuple[str, str, int, str]]:
        return moe_expert_mapping(self, self.config.n_routed_experts) if self.config.n_routed_experts else []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Skips the next-n prediction (MTP) layers: they are the draft model's."""
        return load_weights(self, ((n, t) for n, t in weights if mtp_layer_index(n, self.config) is None))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    default_topk_method = "noaux_tc"
