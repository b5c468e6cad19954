"""atom's vLLM platform: a subclass of the platform vLLM would have picked itself (CPU, CUDA or
ROCm), with the same device identity, that selects atom's attention backend.

vLLM imports this module while it resolves ``vllm.platforms.current_platform``, so it reads
only the built-in detectors and the parent's module, never ``current_platform``.
"""

from __future__ import annotations

import functools
import importlib

import torch

from atom.plugin.vllm import attention_disabled, logger

ATTENTION_BACKEND = "atom.plugin.vllm.attention.ATOMAttentionBackend"
VLLM_GPU_WORKER = "vllm.v1.worker.gpu_worker.Worker"
ATOM_GPU_WORKER = "atom.plugin.vllm.worker.ATOMWorker"  # vLLM's, plus a warm-up of atom's kernels
_EXTENDED = ("CPU", "CUDA", "ROCM")  # PlatformEnum names atom's kernels run on


def _import(qualname: str):
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


@functools.cache
def detect_base_platform() -> str | None:
    """Qualified name of the platform class vLLM picks without plugins, found with vLLM's own
    built-in detectors; None unless exactly one detects a CPU, CUDA or ROCm platform."""
    from vllm.platforms import builtin_platform_plugins

    found = []
    for detect in builtin_platform_plugins.values():
        try:
            qualname = detect()
        except Exception:  # vLLM ignores a failing detector too
            qualname = None
        if qualname:
            found.append(qualname)
    if len(found) != 1:
        logger.warning("atom's vLLM platform stays off: vLLM detects %s platforms (%s)",
                       len(found), ", ".join(found) or "none")
        return None
    if _import(found[0])._enum.name not in _EXTENDED:
        logger.warning("atom's vLLM platform stays off: it extends CPU, CUDA and ROCm platforms, not %s", found[0])
        return None
    return found[0]


def unsupported_attention(selected_backend, config, device_type: str) -> str | None:
    """Why atom's attention backend cannot serve a layer with this selector config, or None."""
    from atom.plugin.vllm.attention import ATOMAttentionBackend as B

    get = functools.partial(getattr, config)
    if selected_backend is not None and getattr(selected_backend, "name", selected_backend) != "CUSTOM":
        return f"attention backend {getattr(selected_backend, 'name', selected_backend)} was asked for"
    needs = {
        "MLA": get("use_mla", False),
        "sparse attention": get("use_sparse", False),
        "attention sinks": get("has_sink", False),
        "multimodal prefix attention": get("use_mm_prefix", False),
        "per-head quantization scales": get("use_per_head_quant_scales", False),
        "sliding window": get("has_sliding_window", False),
        "non-causal attention": get("use_non_causal", False),
        "batch invariance": get("use_batch_invariant", False),
        "a KV connector": get("use_kv_connector", False),
        "context parallelism": get("use_pcp", False) or get("use_dcp", False),
        "adaptive verification": get("use_adaptive_verification", False),
        "R-SWA": get("use_rswa", False),
        f"attention type {get('attn_type', 'decoder')}": get("attn_type", "decoder") != "decoder",
        f"KV cache dtype {get('kv_cache_dtype', None)}": not B.supports_kv_cache_dtype(get("kv_cache_dtype", None)),
        f"dtype {get('dtype', None)}": not B.supports_dtype(get("dtype", torch.float32)),
    }
    head_size = get("head_size", 0)
    if device_type != "cpu":  # the Triton kernels tile the head dim padded to a power of two, at most 256
        needs[f"head size {head_size}"] = not 0 < head_size <= 256
    missing = [name for name, needed in needs.items() if needed]
    return ", ".join(missing) if missing else None


_base_qualname = detect_base_platform()
if _base_qualname is None:
    raise ImportError("atom's vLLM platform needs exactly one CPU, CUDA or ROCm platform detected by vLLM")
_Base = _import(_base_qualname)


class ATOMPlatform(_Base):  # type: ignore[misc, valid-type]
    """vLLM's own platform for this machine, with atom's attention backend."""

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kwargs) -> str:
        if attention_disabled():
            reason = "ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1"
        else:
            reason = unsupported_attention(selected_backend, attn_selector_config, cls.device_type)
        if reason is None:
            from atom.plugin.vllm.attention import register_attention_backend

            register_attention_backend()
            _log_once(f"atom attention backend: {ATTENTION_BACKEND} (atom.ops paged attention over vLLM's KV cache)")
            return ATTENTION_BACKEND
        backend = super().get_attn_backend_cls(selected_backend, attn_selector_config, *args, **kwargs)
        _log_once(f"atom attention backend not used ({reason}): vLLM's {backend}")
        return backend

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        scheduler, cache = vllm_config.scheduler_config, vllm_config.cache_config
        asked = (scheduler.enable_chunked_prefill, scheduler.max_num_batched_tokens, cache.enable_prefix_caching)
        super().check_and_update_config(vllm_config)
        if cls.device_type == "cpu" and runs_atom_mla(vllm_config):
            # vLLM's CPU platform turns both off for its own CPU MLA backend; atom's latent
            # attention reads cached prefixes and earlier chunks from the latent cache
            scheduler.enable_chunked_prefill, scheduler.max_num_batched_tokens, cache.enable_prefix_caching = asked
        parallel = vllm_config.parallel_config
        if cls.device_type == "cuda" and parallel.worker_cls == VLLM_GPU_WORKER:
            parallel.worker_cls = ATOM_GPU_WORKER
        # the first hook that runs after vLLM has configured its logging
        _log_once(f"atom platform active: ATOMPlatform extends {_base_qualname}")


def runs_atom_mla(vllm_config) -> bool:
    """Whether the model is one of atom's multi-head latent attention models with atom's MLA backend."""
    from atom.models.registry import plugin_architectures

    model = vllm_config.model_config
    return (model is not None and getattr(model, "use_mla", False) and not attention_disabled()
            and bool(set(getattr(model, "architectures", None) or []) & set(plugin_architectures(mla=True))))


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)
