"""atom's models inside SGLang.

``atom.plugin.sglang.models`` is an SGLang external model package
(``SGLANG_EXTERNAL_MODEL_PACKAGE=atom.plugin.sglang.models``): atom's model classes with SGLang's
model interface, attention through SGLang's ``RadixAttention`` (SGLang owns the KV cache and the
attention backend). ``register.register_plugin`` (entry point ``sglang.srt.plugins``) registers
them without the variable. ``ATOM_DISABLE_SGLANG_PLUGIN=1`` switches the entry point off.
"""

from __future__ import annotations

import logging

from atom.plugin import env_flag

logger = logging.getLogger("sglang.atom_plugin")
MODEL_PACKAGE = "atom.plugin.sglang.models"


def plugin_disabled() -> bool:
    return env_flag("ATOM_DISABLE_SGLANG_PLUGIN")
