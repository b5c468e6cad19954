"""Quantised weights: the scheme is chosen from the model's ``quantization_config`` (or
``--quantization``) and applied to the built model's linear and MoE layers before loading.

    config = get_fp8_config(hf_config, quantization)
    quantize_layers(model, config)           # e4m3 parameters + scales
    model.load_weights(filter_weights(...))  # the checkpoint
    process_weights_after_loading(model)     # e.g. quantise bf16 weights (--quantization fp8)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import nn

from atom.layers.linear import LinearBase
from atom.layers.moe import FusedMoE
from atom.layers.quantization.fp8 import Fp8LinearMethod, Fp8MoEMethod
from atom.layers.quantization.fp8_config import QUANTIZATION_METHODS, Fp8Config, get_fp8_config

__all__ = ["QUANTIZATION_METHODS", "Fp8Config", "filter_weights", "get_fp8_config", "process_weights_after_loading",
           "quantize_layers"]


def _checkpoint_names(model: nn.Module, name: str) -> list[str]:
    """A module's checkpoint names: a packed module (qkv_proj) stands for its parts."""
    prefix, _, leaf = name.rpartition(".")
    packed = getattr(model, "packed_modules_mapping", {})
    parts = [ckpt for ckpt, (packed_name, _) in packed.items() if packed_name == leaf] or [leaf]
    return [f"{prefix}.{p}" if prefix else p for p in parts]


def quantize_layers(model: nn.Module, config: Fp8Config) -> None:
    """Attach the FP8 methods. MoE routers (``mlp.gate``) stay unquantised, as FP8 checkpoints
    keep them (and vLLM builds them), and so do linear layers marked ``unquantized``; one
    marked ``dequantize_after_loading`` is quantised only to load an FP8 checkpoint."""
    for name, module in model.named_modules():
        if name.endswith(".gate") or config.ignores(_checkpoint_names(model, name)):
            continue
        if isinstance(module, LinearBase):
            if module.unquantized or (module.dequantize_after_loading and not config.serialized):
                continue
            Fp8LinearMethod(config).create_weights(module)
        elif isinstance(module, FusedMoE):
            Fp8MoEMethod(config).create_weights(module)


def filter_weights(weights: Iterable) -> Iterator:
    """Drop the checkpoint tensors atom does not use: static activation scales (activations
    are quantised dynamically)."""
    return ((name, t) for name, t in weights if not name.endswith(".input_scale"))


def process_weights_after_loading(model: nn.Module) -> None:
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
