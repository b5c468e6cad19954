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


# architectures whose attention has no plugin-mode path yet (multi-head latent attention):
# the vLLM/SGLang plugins leave them to the host framework's own implementation
_ENGINE_ONLY = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"})


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def plugin_architectures() -> list[str]:
    """The architectures the vLLM and SGLang plugins replace with atom's classes."""
    return sorted(set(_MODELS) - _ENGINE_ONLY)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
