"""Qwen3-MoE: Qwen3 attention, sparse MoE MLP (router + experts) in most layers."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from atom.distributed.parallel_state import TPInfo
from atom.layers.linear import ReplicatedLinear
from atom.layers.moe import FusedMoE
from atom.models.llama import LlamaMLP
from atom.models.qwen3 import Qwen3ForCausalLM


def num_experts(config: PretrainedConfig) -> int:
    return getattr(config, "num_experts", None) or config.num_local_experts


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TPInfo):
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, num_experts(config), bias=False)
        self.experts = FusedMoE(num_experts(config), config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, config.norm_topk_prob, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


def moe_or_dense(config: PretrainedConfig, tp: TPInfo, layer_idx: int) -> nn.Module:
    sparse = (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and num_experts(config) > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )
    if sparse:
        return Qwen3MoeSparseMoeBlock(config, tp)
    return LlamaMLP(config.hidden_size, config.intermediate_size, tp)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    make_mlp = staticmethod(moe_or_dense)

    def expert_mapping(self) -> list[tuple[str, str, int, str]]:
        return FusedMoE.expert_mapping(num_experts(self.config))
