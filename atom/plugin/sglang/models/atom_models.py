"""The module of the package SGLang scans for ``EntryClass`` (keyed by class name = architecture)."""

from atom.plugin.sglang.models import WRAPPERS

EntryClass = list(WRAPPERS.values())
