"""FP8 KV cache: the cache dtype a ``kv_cache_dtype`` string names, and where a checkpoint's
per-layer ``k_scale``/``v_scale`` go.

The cache stores ``clamp(x / scale)`` in e4m3 (``atom.ops.reference.to_cache_dtype``), one
float32 scale per layer for K and one for V: the checkpoint's when it has them, else 1.0
(vLLM's default without calibration).
"""

from __future__ import annotations

import logging
import re

import torch

from atom.config import KV_CACHE_DTYPES

logger = logging.getLogger(__name__)

FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")

# checkpoint names of the scales: "...self_attn.k_proj.k_scale" (compressed-tensors, vLLM's
# fp8 format), "...self_attn.k_scale", "...self_attn.attn.k_scale"
_SCALE_NAME = re.compile(r"^(.*\.self_attn)\.(?:[kv]_proj\.|attn\.)?([kv]_scale)$")


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")
    return torch.float8_e4m3fn if kv_cache_dtype in FP8_KV_CACHE_DTYPES else model_dtype


def checkpoint_kv_cache_dtype(hf_config) -> str | None:
    """The KV cache a checkpoint's ``quantization_config`` declares, which ``--kv-cache-dtype
    auto`` takes as vLLM does: "fp8" for an 8-bit float scheme (compressed-tensors'
    ``kv_cache_scheme``, ModelOpt's ``kv_cache_quant_algo: FP8``), else None. Per-head scales
    (``strategy: attn_head``) are not supported: None, with a warning."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    if not qc:
        return None
    inner = qc.get("quantization", qc)  # ModelOpt nests its fields
    scheme = next((s for s in (inner.get("kv_cache_scheme"), qc.get("kv_cache_scheme"),
                               inner.get("kv_cache_quant_algo"), qc.get("kv_cache_quant_algo")) if s), None)
    if isinstance(scheme, str):
        return "fp8" if scheme.lower() == "fp8" else None
    if not isinstance(scheme, dict) or (scheme.get("type"), scheme.get("num_bits")) != ("float", 8):
        return None
    if scheme.get("strategy") not in (None, "tensor"):
        logger.warning("the checkpoint's KV cache scheme has %s scales, which atom does not load: the cache "
                       "stays in the model's dtype (--kv-cache-dtype fp8 uses one scale per layer)",
                       scheme.get("strategy"))
        return None
    return "fp8"


def kv_scale_target(name: str) -> str | None:
    """The attention layer's buffer (``<layer>.self_attn.attn.k_scale``) for a checkpoint's KV
    scale tensor, or None if ``name`` is not one."""
    m = _SCALE_NAME.match(name)
    return f"{m.group(1)}.attn.{m.group(2)}" if m else None


def load_kv_scale(buffer: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """Copy a scalar scale; a positive finite number, else the checkpoint is refused."""
    value = loaded.float().reshape(-1)
    if value.numel() != 1 or not bool(torch.isfinite(value).all() and (value > 0).all()):
        raise ValueError(f"{name}: a KV cache scale must be one positive number, got {value.tolist()[:4]}")
    buffer.copy_(value)
