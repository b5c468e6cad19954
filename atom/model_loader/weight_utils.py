"""Route checkpoint tensors to parameters through their ``weight_loader``s."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn

from atom.layers.linear import default_weight_loader
from atom.layers.quantization.kv_cache import kv_scale_target, load_kv_scale
from atom.model_loader.checkpoint_slice import materialize

_SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _route(name: str, packed: dict, experts: list) -> tuple[str, tuple]:
    """(parameter name, extra weight_loader args) for one checkpoint tensor name."""
    for param_name, fragment, expert_id, shard in experts:
        if fragment in name:
            return name.replace(fragment, param_name), (shard, expert_id)
    for ckpt, (packed_name, shard) in packed.items():
        if f".{ckpt}." in name:
            return name.replace(f".{ckpt}.", f".{packed_name}."), (shard,)
    return name, ()


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Load ``weights`` into ``model``; return the parameter names loaded. Raises naming
    every unexpected, missing or mis-shaped tensor, so a bad checkpoint never runs silently
    with random weights."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    packed = getattr(model, "packed_modules_mapping", {})
    experts = model.expert_mapping() if hasattr(model, "expert_mapping") else []
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded_shards: dict[str, set] = defaultdict(set)
    unexpected, errors = [], []
    for name, tensor in weights:
        if any(s in name for s in _SKIPPED) or (tied and name == "lm_head.weight"):
            continue
        scale_buffer = buffers.get(kv_scale_target(name) or "")
        if scale_buffer is not None:  # an FP8 KV cache scale
            try:
                load_kv_scale(scale_buffer, materialize(tensor), name)
            except ValueError as e:
                errors.append(str(e))
            continue
        param_name, extra = _route(name, packed, experts)
        param = params.get(param_name)
        if param is None:
            unexpected.append(name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, *extra)
        except ValueError as e:
            errors.append(f"{name}: {e}")
        loaded_shards[param_name].add(extra)
    missing = sorted(set(params) - set(loaded_shards))
    expected = _expected_shards(packed, experts)
    incomplete = sorted(p for p, shards in loaded_shards.items() if len(shards) < expected.get(_leaf(p), 0))
    problems = []
    if errors:
        problems.append("tensors with wrong shapes: " + "; ".join(errors))
    if unexpected:
        problems.append(f"unexpected tensors in checkpoint: {', '.join(unexpected[:20])}"
                        + (f" (+{len(unexpected) - 20} more)" if len(unexpected) > 20 else ""))
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:20])}"
                        + (f" (+{len(missing) - 20} more)" if len(missing) > 20 else ""))
    if incomplete:
        problems.append(f"packed parameters missing some parts: {', '.join(incomplete[:20])}")
    if problems:
        raise ValueError("checkpoint does not match the model: " + " | ".join(problems))
    return set(loaded_shards)


def _leaf(param_name: str) -> str:
    """'model.layers.0.self_attn.qkv_proj.weight' -> 'qkv_proj.weight'."""
    return ".".join(param_name.split(".")[-2:])


def _expected_shards(packed: dict, experts: list) -> dict[str, int]:
    """Number of loads each packed parameter needs, keyed by '<module>.<param>'."""
    counts: dict[str, int] = defaultdict(int)
    for packed_name, _ in packed.values():
        counts[f"{packed_name}.weight"] += 1
        counts[f"{packed_name}.bias"] += 1
    for param_name, *_ in experts:
        counts[param_name] += 1
    return counts
