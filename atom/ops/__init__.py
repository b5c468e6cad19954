"""The kernel boundary: one function per (fused) op.

Each function takes plain tensors and dispatches by device: the Triton kernel of
``atom.ops.triton`` on a CUDA/ROCm tensor when Triton is importable, the PyTorch
reference of ``atom.ops.reference`` otherwise. ``ATOM_FORCE_REFERENCE_OPS=1`` forces the
reference everywhere (for debugging a kernel).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable

from atom.ops import reference

__all__ = [
    "fused_moe",
    "moe_topk",
    "paged_attention",
    "qk_norm_rope_store",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv_cache",
    "top_k_top_p_min_p",
    "use_triton",
]


@functools.cache
def _triton_module():
    if os.environ.get("ATOM_FORCE_REFERENCE_OPS", "0") == "1":
        return None
    try:
        return importlib.import_module("atom.ops.triton")
    except ImportError:
        return None


def use_triton(device) -> bool:
    """Whether ops on ``device`` run the Triton kernels."""
    return getattr(device, "type", device) == "cuda" and _triton_module() is not None


def _dispatch(name: str) -> Callable:
    ref = getattr(reference, name)

    @functools.wraps(ref)
    def op(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))
        if first.is_cuda:
            mod = _triton_module()
            impl = getattr(mod, name, None) if mod is not None else None
            if impl is not None:
                return impl(*args, **kwargs)
        return ref(*args, **kwargs)

    return op


rms_norm = _dispatch("rms_norm")
silu_and_mul = _dispatch("silu_and_mul")
rotary_embedding = _dispatch("rotary_embedding")
store_kv_cache = _dispatch("store_kv_cache")
qk_norm_rope_store = _dispatch("qk_norm_rope_store")
paged_attention = _dispatch("paged_attention")
moe_topk = _dispatch("moe_topk")
fused_moe = _dispatch("fused_moe")
top_k_top_p_min_p = _dispatch("top_k_top_p_min_p")
