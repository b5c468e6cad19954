"""Model classes keyed by the ``architectures`` entry of a Hugging Face config."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS = {
    "DeepseekV2ForCausalLM": ("atom.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("atom.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "LlamaForCausalLM": ("atom.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("atom.models.llama", "LlamaForCausalLM"),  # Llama's layers and names
    "Qwen2ForCausalLM": ("atom.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("atom.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("atom.models.qwen3_moe", "Qwen3MoeForCausalLM"),
}


# multi-head latent attention: a plugin-mode path in the vLLM plugin only (SGLang leaves them
# to its own implementation)
_MLA = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"})
# atom's engine only: the frameworks' Mistral also loads Mistral's own checkpoint format
# (consolidated.safetensors, params.json), whose weight names atom's loader does not know
_ENGINE_ONLY = frozenset({"MistralForCausalLM"})


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def plugin_architectures(mla: bool = False) -> list[str]:
    """The architectures a plugin replaces with atom's classes; ``mla``: with the DeepSeek
    (multi-head latent attention) ones, whose host layer only the vLLM plugin builds."""
    return sorted(set(_MODELS) - _ENGINE_ONLY - (set() if mla else _MLA))


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
