"""atom inside other serving frameworks.

``atom.plugin.vllm``: an out-of-tree vLLM platform (atom's models and attention kernels inside
vLLM's scheduler, KV-cache manager and API server), found through the entry points in
``pyproject.toml``. ``atom.plugin.sglang``: atom's models as an SGLang external model package.
Importing these packages never imports the host framework; the entry-point functions do.
"""

from __future__ import annotations

import os


def env_flag(name: str, default: bool = False) -> bool:
    """A boolean environment switch: 1/true/yes/on (any case) is on, 0/false/no/off or empty is off."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected 0 or 1")
