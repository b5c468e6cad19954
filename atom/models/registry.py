"""Model classes keyed by the ``architectures`` entry of a Hugging Face config."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS = {
    "DeepseekV2ForCausalLM": ("atom.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("atom.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "LlamaForCausalLM": ("atom.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("atom.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("atom.models.qwen3_moe", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
