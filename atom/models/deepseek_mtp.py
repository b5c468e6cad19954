"""DeepSeek-V3's multi-token prediction (MTP) layers, the draft of MTP speculative decoding.

A checkpoint with ``num_nextn_predict_layers = n`` stores, after its ``num_hidden_layers``
decoder layers, ``n`` more under ``model.layers.{num_hidden_layers + i}``: a full decoder
layer plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.{norm,head}``. MTP layer
``i`` predicts the token after next from the token embedding and the previous depth's
hidden state::

    h = eh_proj(cat(enorm(embed(token)), hnorm(previous_hidden)))   # embedding 0 at position 0
    h = decoder_layer(h) + its residual                              # the MTP hidden state
    logits = shared_head.head(shared_head.norm(h))

For the first draft token ``previous_hidden`` is the target model's output at the same
position (``DeepseekV3ForCausalLM.forward`` returns those hidden states); for the next ones
it is the MTP hidden state of the previous draft step. The attention of the MTP decoder
layer is an ``MLAAttention`` like the target's: the runner allocates its latent cache and
finds it, by prefix, in the forward context.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from atom.distributed.parallel_state import SINGLE, TPInfo
from atom.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from atom.layers.layernorm import RMSNorm
from atom.layers.linear import ReplicatedLinear
from atom.layers.rotary_embedding import share_cos_sin_caches
from atom.model_loader.weight_utils import load_weights
from atom.models.deepseek_v2 import (
    DeepseekAttention,
    DeepseekV3ForCausalLM,
    deepseek_mlp,
    moe_expert_mapping,
    mtp_layer_index,
    packed_modules,
)
from atom.models.llama import DecoderLayer


class SharedHead(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TPInfo):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)


class DeepseekMTPLayer(DecoderLayer):
    """A decoder layer (its parameters named as in the checkpoint) plus the MTP projections."""

    def __init__(self, config: PretrainedConfig, tp: TPInfo, layer_idx: int):
        make_mlp = functools.partial(deepseek_mlp, default_topk_method=DeepseekV3ForCausalLM.default_topk_method)
        super().__init__(config, tp, layer_idx, False, make_mlp, DeepseekAttention)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * config.hidden_size, config.hidden_size)
        self.eh_proj.unquantized = True  # bf16 in FP8 checkpoints (DeepSeek-V3/R1)
        self.shared_head = SharedHead(config, tp)

    def predict(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                previous_hidden_states: torch.Tensor) -> torch.Tensor:  # fmt: skip
        # the token at position 0 has no previous token to predict from: its embedding is zeroed
        inputs_embeds = inputs_embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = torch.cat((self.enorm(inputs_embeds), self.hnorm(previous_hidden_states)), dim=-1)
        hidden_states, residual = self(positions, self.eh_proj(x), None)
        return hidden_states + residual


class DeepseekMTP(nn.Module):
    """The ``num_nextn_predict_layers`` MTP layers of a DeepSeek-V3 checkpoint. Draft step
    ``k`` uses layer ``k % num_layers`` (one layer, applied K times, is the usual setup)."""

    def __init__(self, config: PretrainedConfig, tp: TPInfo = SINGLE):
        super().__init__()
        self.config = config
        self.packed_modules_mapping = packed_modules(config)
        self.num_layers = getattr(config, "num_nextn_predict_layers", 0) or 0
        if self.num_layers < 1:
            raise ValueError("the checkpoint has no MTP layers (num_nextn_predict_layers is 0)")
        first = config.num_hidden_layers
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.model.layers = nn.ModuleDict(
            {str(first + i): DeepseekMTPLayer(config, tp, first + i) for i in range(self.num_layers)}
        )
        share_cos_sin_caches(self)

    def layer(self, spec_step_idx: int) -> DeepseekMTPLayer:
        return self.model.layers[str(self.config.num_hidden_layers + spec_step_idx % self.num_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden_states: torch.Tensor,
                spec_step_idx: int = 0) -> torch.Tensor:  # fmt: skip
        """Hidden states [T, hidden] of draft step ``spec_step_idx``; ``input_ids`` are the
        tokens at ``positions`` (each row's next token, i.e. the target's inputs shifted by one)."""
        embeds = self.model.embed_tokens(input_ids)
        return self.layer(spec_step_idx).predict(embeds, positions, previous_hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        head = self.layer(spec_step_idx).shared_head
        return head.head(head.norm(hidden_states))

    def expert_mapping(self) -> list[tuple[str, str, int, str]]:
        n = getattr(self.config, "n_routed_experts", None)
        return moe_expert_mapping(self, n) if n else []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights(self, self._mtp_weights(weights))

    def _mtp_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The MTP layers' tensors from a whole checkpoint. The embedding and the output head
        are shared with the target model (DeepSeek-V3 stores the same tensors again in each
        MTP layer): the target's and a layer's own copy are both accepted."""
        for name, tensor in weights:
            index = mtp_layer_index(name, self.config)
            if name == "model.embed_tokens.weight" or (index is not None and name.endswith(".embed_tokens.weight")):
                yield "model.embed_tokens.weight", tensor
            elif name == "lm_head.weight":
                for key in self.model.layers:
                    yield f"model.layers.{key}.shared_head.head.weight", tensor
            elif index is not None and index < self.num_layers:
                yield name, tensor
