"""The function SGLang's ``sglang.srt.plugins`` entry point calls, early in every SGLang process."""

from __future__ import annotations

import os
import sys

from atom.plugin.sglang import MODEL_PACKAGE, logger, plugin_disabled

_ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"


def register_plugin() -> None:
    """Make SGLang resolve the architectures atom implements to atom's models (idempotent).

    Before SGLang's model registry exists, naming atom's package in ``SGLANG_EXTERNAL_MODEL_PACKAGE``
    is enough (SGLang registers that package's models over its own when it builds the registry);
    once it exists, or when that variable names another package, atom's classes go into the registry."""
    if plugin_disabled():
        return
    registry_loaded = "sglang.srt.models.registry" in sys.modules
    if not registry_loaded and os.environ.get(_ENV, MODEL_PACKAGE) == MODEL_PACKAGE:
        os.environ[_ENV] = MODEL_PACKAGE
        return
    from sglang.srt.models.registry import ModelRegistry, import_model_classes

    models = import_model_classes(MODEL_PACKAGE)
    ModelRegistry.models.update(models)
    logger.info("atom models registered with SGLang for %s", ", ".join(sorted(models)))
