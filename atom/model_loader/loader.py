"""Build a model and fill its weights: safetensors (single or sharded), GGUF, or dummy."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from atom.config import ModelConfig
from atom.distributed.parallel_state import SINGLE, TPInfo
from atom.layers.quantization import filter_weights, get_fp8_config, process_weights_after_loading, quantize_layers
from atom.model_loader.checkpoint_slice import CheckpointSlice
from atom.models.registry import get_model_class

logger = logging.getLogger(__name__)


def safetensors_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_path, n) for n in names]
        absent = [f for f in files if not os.path.exists(f)]
        if absent:
            raise FileNotFoundError(f"shards listed in {index} are missing: {absent}")
        return files
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_path}")
    return files


def iter_safetensors(model_path: str) -> Iterator[tuple[str, CheckpointSlice]]:
    """Every tensor as a lazy slice: each rank's weight loaders read only their shard, so no
    rank ever holds (or reads) the full model."""
    files = safetensors_files(model_path)
    for path in tqdm(files, desc="Loading safetensors shards", disable=len(files) == 1):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, CheckpointSlice(f.get_slice(name))


def iter_weights(model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor | CheckpointSlice]]:
    from atom.model_loader.gguf import find_gguf_file, iter_gguf_weights

    gguf_file = find_gguf_file(model_config.model)
    if gguf_file is not None:
        return iter_gguf_weights(gguf_file, model_config.dtype)
    return iter_safetensors(model_config.model)


def is_mtp_weight(name: str, hf_config) -> bool:
    """A tensor of the checkpoint's next-n prediction (MTP) layers, which follow the decoder
    layers (``model.layers.{num_hidden_layers + i}``): the draft's, not the target's."""
    if not getattr(hf_config, "num_nextn_predict_layers", 0) or not name.startswith("model.layers."):
        return False
    index = name.split(".")[2]
    return index.isdigit() and int(index) >= hf_config.num_hidden_layers


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights of a sane scale (norm weights stay 1), for benchmarks on real shapes."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name or "scale" in name:  # norms, and FP8 weight scales
            param.data.fill_(1.0)
            continue
        cpu = (
            torch.empty(param.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
            if param.numel() < (1 << 24)
            else None
        )
        if cpu is not None:
            param.data.copy_(cpu)
        else:  # large tensors: generate on the device, seeded from the CPU generator
            dev_gen = torch.Generator(device=param.device).manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
            # normal_ has no float8 kernel: FP8 weights are drawn in bf16, then rounded
            draw = param.data if param.element_size() > 1 else torch.empty_like(param.data, dtype=torch.bfloat16)
            param.data.copy_(draw.normal_(0.0, 0.02, generator=dev_gen))


def build_model(cls: type[nn.Module], model_config: ModelConfig, device: torch.device, tp: TPInfo) -> nn.Module:
    """``cls(hf_config, tp)`` with its parameters created on ``device`` in the model's dtype (the default
    dtype is restored after)."""
    prev_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device):
            return cls(model_config.hf_config, tp)
    finally:
        torch.set_default_dtype(prev_dtype)


def load_quantized(model: nn.Module, model_config: ModelConfig, weights: Iterable | None, seed: int) -> nn.Module:
    """Apply the model's FP8 scheme (if any) to a built model, fill it from ``weights`` (random
    ones with ``--load_dummy``) and finish the quantised layers. Shared by the target model and
    the MTP draft, whose layers are FP8 in FP8 checkpoints too."""
    quant = get_fp8_config(model_config.hf_config, model_config.quantization)
    if quant is not None:
        quantize_layers(model, quant)
    if model_config.load_dummy:
        init_dummy_weights(model, seed)
    else:
        model.load_weights(filter_weights(weights))
    process_weights_after_loading(model)
    return model.eval()


def load_model(model_config: ModelConfig, device: torch.device, tp: TPInfo = SINGLE) -> nn.Module:
    model = build_model(get_model_class(model_config.architecture), model_config, device, tp)
    hf = model_config.hf_config
    weights = None if model_config.load_dummy else (
        (name, w) for name, w in iter_weights(model_config) if not is_mtp_weight(name, hf))
    return load_quantized(model, model_config, weights, model_config.seed)
