"""The two functions vLLM's entry points call, in every vLLM process (API server, engine core,
workers), possibly more than once: both are cheap and idempotent."""

from __future__ import annotations

from atom.plugin.vllm import logger, models_disabled, plugin_disabled, vllm_unsupported

PLATFORM_CLS = "atom.plugin.vllm.platform.ATOMPlatform"
WRAPPER_MODULE = "atom.plugin.vllm.model_wrapper"


def _switched_off() -> bool:
    try:
        if plugin_disabled():
            return True
    except ValueError as e:  # a malformed switch turns the plugin off, loudly
        logger.error("%s; atom's vLLM plugin stays off", e)
        return True
    return vllm_unsupported() is not None


def register_platform() -> str | None:
    """``vllm.platform_plugins`` entry point: the qualified name of atom's platform class, or
    None (vLLM then picks its own platform) when the plugin is switched off, the vLLM version is
    not supported, or vLLM detects no CPU/CUDA/ROCm platform for atom to extend.

    vLLM calls this while it resolves ``vllm.platforms.current_platform``, so nothing here (nor
    the platform module) may read ``current_platform``."""
    if _switched_off():
        return None
    from atom.plugin.vllm.platform import detect_base_platform

    if detect_base_platform() is None:
        return None
    return PLATFORM_CLS


def register_model() -> None:
    """``vllm.general_plugins`` entry point: point every architecture atom implements at a thin
    wrapper around atom's model class in vLLM's ``ModelRegistry`` (lazily, by name: the class is
    imported only when vLLM builds that model). ``ATOM_DISABLE_VLLM_PLUGIN_MODELS=1`` keeps
    vLLM's own model classes (atom's platform and attention backend stay)."""
    if _switched_off():
        return
    try:
        if models_disabled():
            logger.info("ATOM_DISABLE_VLLM_PLUGIN_MODELS is set: vLLM's own models run, on atom's attention backend")
            return
    except ValueError as e:  # a malformed switch leaves vLLM's models in place, loudly
        logger.error("%s; atom's models are not registered", e)
        return
    from vllm import ModelRegistry

    from atom.models.registry import plugin_architectures
    from atom.plugin.vllm.model_wrapper import wrapper_name

    registered = []
    for arch in plugin_architectures(mla=True):
        target = f"{WRAPPER_MODULE}:{wrapper_name(arch)}"
        current = ModelRegistry.models.get(arch)
        if f"{getattr(current, 'module_name', '')}:{getattr(current, 'class_name', '')}" == target:
            continue  # already registered in this process
        ModelRegistry.register_model(arch, target)
        registered.append(arch)
    if registered:
        logger.info("atom models registered with vLLM for %s", ", ".join(registered))
