"""A DeepSeek-style multi-token-prediction (MTP) layer for Llama/Qwen3 decoder blocks.

The checkpoint's ``num_nextn_predict_layers`` extra layers sit after the last decoder
layer (``model.layers.{num_hidden_layers}.*``, DeepSeek-V3's names): ``enorm`` and ``hnorm``
normalise the next token's embedding and the previous position's hidden state,
``eh_proj`` mixes them, a decoder block runs with its own KV cache, and ``shared_head.norm``
precedes the target's LM head. The embedding and the head are the target's
(``bind_target``). Used by ``atom/spec_decode`` (method ``mtp``) and its tests.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from atom.distributed.parallel_state import SINGLE, TPInfo
from atom.layers.layernorm import RMSNorm
from atom.layers.linear import ReplicatedLinear
from atom.model_loader.weight_utils import load_weights
from atom.models.llama import DecoderLayer, LlamaForCausalLM, dense_mlp

# checkpoint tensors of the MTP layer that duplicate the target's (DeepSeek-V3 stores them)
_SHARED_WITH_TARGET = ("embed_tokens.weight", "shared_head.head.weight")


class SharedHead(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MtpLayer(DecoderLayer):
    def __init__(self, config: PretrainedConfig, tp: TPInfo, layer_idx: int, qk_norm: bool):
        super().__init__(config, tp, layer_idx, qk_norm, dense_mlp)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * config.hidden_size, config.hidden_size)
        self.eh_proj.unquantized = True  # high precision, as in DeepSeek-V3/R1's FP8 checkpoints
        self.shared_head = SharedHead(config)


class _Layers(nn.Module):
    def __init__(self, layers: dict[str, nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict(layers)


class LlamaMTP(nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config: PretrainedConfig, tp: TPInfo = SINGLE):
        super().__init__()
        self.config = config
        n = config.num_hidden_layers
        qk_norm = config.model_type.startswith("qwen3")
        self.model = _Layers({str(n): MtpLayer(config, tp, n, qk_norm)})
        self.mtp = self.model.layers[str(n)]
        self._target: tuple[nn.Module, ...] = ()  # a tuple, so its parameters stay the target's

    def bind_target(self, target: nn.Module) -> None:
        self._target = (target,)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden_states: torch.Tensor
    ) -> torch.Tensor:
        layer = self.mtp
        embeds = self._target[0].embed_input_ids(input_ids)
        embeds = torch.where((positions == 0)[:, None], 0.0, embeds)  # position 0 has no previous token
        hidden = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(previous_hidden_states)], dim=-1))
        hidden, residual = layer(positions, hidden, None)
        return hidden + residual

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(self.mtp.shared_head.norm(hidden_states))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Takes the MTP layer's tensors from the whole checkpoint."""
        prefix = f"model.layers.{self.config.num_hidden_layers}."
        return load_weights(
            self, ((k, w) for k, w in weights if k.startswith(prefix) and not k.endswith(_SHARED_WITH_TARGET))
        )
