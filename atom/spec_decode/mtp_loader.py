"""Build the draft module of method ``mtp`` and load the checkpoint's MTP layer into it.

The class comes from the target's architecture: DeepSeek checkpoints get
``atom.models.deepseek_mtp.DeepseekMTP``, Llama/Qwen3-style ones the generic
``atom.models.llama_mtp.LlamaMTP``. A draft class takes ``(hf_config, tp)``; its
``load_weights`` gets the whole checkpoint and takes its own tensors (those named
``model.layers.{num_hidden_layers + i}.*``, and the embedding and head if it keeps copies);
it may share the target's embedding and head through ``bind_target(target)`` instead.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from atom.config import ModelConfig
from atom.distributed.parallel_state import TPInfo
from atom.model_loader.loader import build_model, iter_weights, load_quantized

_DRAFTS = {
    "DeepseekV3ForCausalLM": ("atom.models.deepseek_mtp", "DeepseekMTP"),
    "DeepseekV2ForCausalLM": ("atom.models.deepseek_mtp", "DeepseekMTP"),
}
_GENERIC = ("atom.models.llama_mtp", "LlamaMTP")


def load_mtp(model_config: ModelConfig, target: nn.Module | None, device: torch.device, tp: TPInfo) -> nn.Module:
    module, name = _DRAFTS.get(model_config.architecture, _GENERIC)
    draft = build_model(getattr(importlib.import_module(module), name), model_config, device, tp)
    if hasattr(draft, "bind_target"):
        draft.bind_target(target)
    # it takes its own tensors from the whole checkpoint
    weights = None if model_config.load_dummy else iter_weights(model_config)
    return load_quantized(draft, model_config, weights, model_config.seed + 1)
