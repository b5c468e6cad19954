"""Next-n prediction (MTP) layers for a tiny DeepSeek-V3 checkpoint. Hugging Face's model
has no MTP layers, so they are written as an extra shard, ``mtp.safetensors``, in the
checkpoint's own naming (``model.layers.{num_hidden_layers + i}.*``, per-expert weights)."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file


def mtp_layer_tensors(config, layer_idx: int, seed: int) -> dict[str, torch.Tensor]:
    """Random weights of one MTP layer, keyed by checkpoint name."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    gen = torch.Generator().manual_seed(seed)
    layer = DeepseekV3DecoderLayer(config, layer_idx)
    h, std = config.hidden_size, config.initializer_range
    tensors = {}
    for name, t in list(layer.state_dict().items()):
        if "norm" in name:
            tensors[name] = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = 0.3 * torch.randn(t.shape, generator=gen)
        elif name == "mlp.experts.gate_up_proj":
            full, inter = std * torch.randn(t.shape, generator=gen), t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors[f"mlp.experts.{e}.gate_proj.weight"] = full[e, :inter]
                tensors[f"mlp.experts.{e}.up_proj.weight"] = full[e, inter:]
        elif name == "mlp.experts.down_proj":
            full = std * torch.randn(t.shape, generator=gen)
            for e in range(t.shape[0]):
                tensors[f"mlp.experts.{e}.down_proj.weight"] = full[e]
        else:
            tensors[name] = std * torch.randn(t.shape, generator=gen)
    tensors["enorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    tensors["hnorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    tensors["eh_proj.weight"] = std * torch.randn(h, 2 * h, generator=gen)
    tensors["shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    tensors["shared_head.head.weight"] = std * torch.randn(config.vocab_size, h, generator=gen)
    return {f"model.layers.{layer_idx}.{k}": v.contiguous() for k, v in tensors.items()}


def write_mtp_layers(config, out_dir: str, seed: int, dtype: torch.dtype) -> None:
    tensors = {}
    for i in range(getattr(config, "num_nextn_predict_layers", 0) or 0):
        layer_idx = config.num_hidden_layers + i
        tensors.update(mtp_layer_tensors(config, layer_idx, seed + layer_idx))
    if tensors:
        save_file({k: v.to(dtype) for k, v in tensors.items()}, os.path.join(out_dir, "mtp.safetensors"))
