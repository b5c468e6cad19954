"""Which FP8 scheme a model uses, read from its ``quantization_config`` (or ``--quantization
fp8`` for a high-precision checkpoint), as vLLM picks a quantisation config.

Formats loaded:
- ``{"quant_method": "fp8", "weight_block_size": [128, 128]}`` (DeepSeek-V3, Qwen3-FP8):
  e4m3 weights with one ``weight_scale_inv`` per 128x128 block;
- ``{"quant_method": "fp8"}`` without blocks (vLLM's format): a per-tensor ``weight_scale``;
- ``compressed-tensors`` with 8-bit float weights, strategy ``tensor``, ``channel`` or
  ``block``: ``weight_scale`` per tensor, per output channel or per block.
Activations are always quantised dynamically (per token, or per 128-column group with block
weights); a checkpoint's static ``input_scale`` is not used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from transformers import PretrainedConfig

QUANTIZATION_METHODS = ("fp8",)


@dataclass(frozen=True, slots=True)
class Fp8Config:
    block: tuple[int, int] | None  # (rows, columns) of a weight scale block; None: per tensor/channel
    serialized: bool  # the checkpoint holds e4m3 weights (else they are quantised on load)
    scale_name: str  # the checkpoint's name of the weight scales
    ignore: tuple[str, ...] = ()  # checkpoint module names (or "re:" patterns) left unquantised

    @property
    def group_k(self) -> int:
        """Input columns per scale (0: the whole row)."""
        return self.block[1] if self.block else 0

    def ignores(self, checkpoint_names: list[str]) -> bool:
        """Whether a module, known by the checkpoint names of its parts, stays unquantised."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if any(re.match(pattern[3:], n) for n in checkpoint_names):
                    return True
            elif any(n == pattern or n.endswith("." + pattern) for n in checkpoint_names):
                return True
        return False


def get_fp8_config(hf_config: PretrainedConfig, quantization: str | None) -> Fp8Config | None:
    """The model's FP8 scheme, or None for an unquantised model."""
    if quantization not in (None, *QUANTIZATION_METHODS):
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {quantization!r}")
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    if not qc:
        return Fp8Config(None, serialized=False, scale_name="weight_scale") if quantization == "fp8" else None
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        ignore = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
        return Fp8Config(_block(block), True, "weight_scale_inv" if block else "weight_scale", tuple(ignore))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ValueError(f"checkpoint quantization {method!r} is not supported: atom loads FP8 checkpoints "
                     "(quant_method 'fp8' or 'compressed-tensors' with 8-bit float weights)")


def _block(block) -> tuple[int, int] | None:
    if block is None:
        return None
    if len(block) != 2 or min(block) < 16 or block[1] & (block[1] - 1):
        raise ValueError(f"weight block size must be [rows, columns] with a power-of-two column count >= 16, "
                         f"got {block}")
    return int(block[0]), int(block[1])


def _compressed_tensors(qc: dict) -> Fp8Config | None:
    schemes = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
    if not schemes:
        if qc.get("kv_cache_scheme"):
            return None  # only the KV cache is quantised (its scheme: kv_cache.checkpoint_kv_cache_dtype)
        raise ValueError("compressed-tensors checkpoint without config_groups")
    kinds = {(w.get("type"), w.get("num_bits"), w.get("strategy"), tuple(w.get("block_structure") or ()))
             for w in schemes}
    if len(kinds) != 1:
        raise ValueError(f"compressed-tensors checkpoints mixing weight schemes are not supported: {sorted(kinds)}")
    kind, bits, strategy, block = kinds.pop()
    if (kind, bits) != ("float", 8) or strategy not in ("tensor", "channel", "block"):
        raise ValueError(f"compressed-tensors scheme {kind}/{bits} bits/{strategy} is not supported: atom loads "
                         "8-bit float weights per tensor, channel or block")
    return Fp8Config(_block(list(block)) if strategy == "block" else None, True, "weight_scale",
                     tuple(qc.get("ignore") or ()))
