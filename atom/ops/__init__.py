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

import torch

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
    "init_device_ops",
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


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t)


# Output shapes for torch.compile's fake tensors. Each Triton op is registered as an opaque
# custom op, so compiled graphs call the kernel rather than tracing its Python launcher.
_FAKES: dict[str, Callable] = {
    "rms_norm": lambda x, weight, eps: _empty_like(x),
    "fused_add_rms_norm": lambda x, weight, eps, residual: (_empty_like(x), _empty_like(x)),
    "silu_and_mul": lambda x: x.new_empty((*x.shape[:-1], x.shape[-1] // 2)),
    "rotary_embedding": lambda positions, q, k, cos_sin_cache: (_empty_like(q), _empty_like(k)),
    "store_kv_cache": lambda *args: None,
    "qk_norm_rope_store": lambda q, k, *args: (_empty_like(q), _empty_like(k)),
    "paged_attention": lambda q, *args: _empty_like(q),
    "moe_topk": lambda logits, top_k, renormalize: (
        logits.new_empty((logits.shape[0], top_k), dtype=torch.float32),
        logits.new_empty((logits.shape[0], top_k), dtype=torch.int64)),
    "fused_moe": lambda x, *args: _empty_like(x),
    "top_k_top_p_min_p": lambda logits, *args: _empty_like(logits),
}
_MUTATES = {"store_kv_cache": ("k_cache", "v_cache"), "qk_norm_rope_store": ("k_cache", "v_cache")}


def _fused_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                        residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.rms_norm(x, weight, eps, residual)


def _plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return reference.rms_norm(x, weight, eps)


def _make_custom_op(mod, name: str):
    """``torch.ops.atom.triton_<name>`` backed by the Triton kernel of the same semantics."""
    if name == "rms_norm":
        sig_fn, impl = _plain_rms_norm, lambda x, w, eps: mod.rms_norm(x, w, eps)
    elif name == "fused_add_rms_norm":
        sig_fn, impl = _fused_add_rms_norm, lambda x, w, eps, r: mod.rms_norm(x, w, eps, r)
    else:
        sig_fn, impl = getattr(reference, name), getattr(mod, name)
    mutates = _MUTATES.get(name, ())
    schema = torch.library.infer_schema(sig_fn, mutates_args=mutates)
    op = torch.library.custom_op(f"atom::triton_{name}", impl, mutates_args=mutates, device_types="cuda",
                                 schema=schema)
    op.register_fake(_FAKES[name])
    return getattr(torch.ops.atom, f"triton_{name}").default


# name -> custom op, filled once by init_device_ops; a plain dict, so torch.compile traces
# the lookup instead of breaking the graph on a cached function
_CUDA_OPS: dict[str, Callable] = {}


def init_device_ops(device) -> None:
    """Register the Triton ops for a CUDA device. The model runner calls this before any
    compilation; the first CUDA op call does it otherwise. Triton is imported lazily so
    that tests can switch it to its interpreter first."""
    if getattr(device, "type", device) != "cuda" or _CUDA_OPS:
        return
    mod = _triton_module()
    if mod is None:
        return
    for name in _FAKES:
        _CUDA_OPS[name] = _make_custom_op(mod, name)


def _dispatch(name: str) -> Callable:
    ref = getattr(reference, name)

    @functools.wraps(ref)
    def op(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))
        if first.is_cuda:
            if not _CUDA_OPS:
                init_device_ops(first.device)
            if _CUDA_OPS:
                if name == "rms_norm":
                    residual = args[3] if len(args) > 3 else kwargs.get("residual")
                    if residual is not None:
                        return _CUDA_OPS["fused_add_rms_norm"](*args[:3], residual)
                    return _CUDA_OPS["rms_norm"](*args[:3])
                return _CUDA_OPS[name](*args, **kwargs)
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
