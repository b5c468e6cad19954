"""GGUF checkpoints (llama.cpp's single-file format) read as a Hugging Face config, tokenizer and weights.

A GGUF file holds everything in one place: the model hyper-parameters and the tokenizer as metadata
key/values, and the weights as (often quantized) tensors under llama.cpp's names. This module turns
them into what the rest of atom expects from a Hugging Face checkpoint:

* ``load_gguf_config``   -> ``transformers.PretrainedConfig`` (LlamaConfig, Qwen2Config, Qwen3Config, ...)
* ``load_gguf_tokenizer`` -> a fast tokenizer with the file's chat template
* ``iter_gguf_weights``  -> ``(hf_name, tensor)`` pairs, dequantized, named as in an HF checkpoint
* ``save_gguf_as_hf``    -> all three written as a safetensors + tokenizer directory

Dequantization uses the ``gguf`` package's (numpy) dequantizer, so every type it knows is supported
(F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants, the IQ types); the result is the same
as ``transformers``' GGUF loading, tensor for tensor.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

# GGUF ``general.architecture`` -> (HF model_type, HF architecture class). Only decoder-only
# transformers atom can run; transformers' GGUF support covers these four too.
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# ``blk.{i}.<gguf>.{weight,bias}`` -> ``model.layers.{i}.<hf>.{weight,bias}``
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # MoE router
}

# MoE experts are stacked in one 3-D tensor per projection in GGUF; HF checkpoints store one 2-D
# tensor per expert (``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``), so they are split.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}

_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")

_GGUF_FILE = re.compile(r".*\.gguf$", re.IGNORECASE)
_SPLIT_GGUF = re.compile(r".*-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)

_MISSING = object()


def find_gguf_file(path: str) -> str | None:
    """The GGUF file ``path`` names: itself if it is a ``.gguf`` file, the single ``.gguf`` inside it if it
    is a directory, else None. Raises ValueError when a directory holds several and the choice is ambiguous."""
    if os.path.isfile(path):
        return path if _GGUF_FILE.match(path) else None
    if not os.path.isdir(path):
        return None
    found = sorted(name for name in os.listdir(path) if _GGUF_FILE.match(name))
    if not found:
        return None
    split = [name for name in found if _SPLIT_GGUF.match(name)]
    if split:
        # A model split by llama-gguf-split: each part holds only some tensors.
        raise ValueError(
            f"{path} holds a split GGUF ({split[0]}, ...); atom reads single-file GGUF only. "
            "Merge it first: llama-gguf-split --merge <first part> merged.gguf"
        )
    if len(found) > 1:
        raise ValueError(f"{path} holds several GGUF files ({', '.join(found)}); pass the path of the one to load")
    return os.path.join(path, found[0])


@functools.lru_cache(maxsize=2)
def _open_reader(path: str, _size: int, _mtime_ns: int):
    # Parsing the header of a GGUF with a 50k-token vocabulary takes seconds (gguf-py builds a view per
    # string), and config, tokenizer and weights all need it: parse once per file and process.
    # The size and mtime are in the key so that a file replaced on disk is read again.
    import gguf

    start = time.perf_counter()
    reader = gguf.GGUFReader(path)
    logger.debug("Parsed GGUF header of %s in %.2f s", path, time.perf_counter() - start)
    return reader


def _reader(gguf_file: str):
    path = os.path.abspath(gguf_file)
    stat = os.stat(path)
    return _open_reader(path, stat.st_size, stat.st_mtime_ns)


def _field(reader, key: str, default=_MISSING):
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF file {reader.data.filename} has no metadata key {key!r}")
        return default
    return field.contents()


def load_gguf_config(gguf_file: str):
    """A ``transformers.PretrainedConfig`` built from the GGUF metadata.

    Besides ``rope_parameters`` (transformers 5) the config also carries ``rope_theta`` as a plain
    attribute, so code written for either transformers generation reads the right base frequency.
    """
    from transformers import AutoConfig

    reader = _reader(gguf_file)
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported by atom (supported: {', '.join(_ARCHITECTURES)})"
        )
    model_type, hf_arch = _ARCHITECTURES[arch]

    def arch_field(key, default=_MISSING):
        return _field(reader, f"{arch}.{key}", default)

    tensor_names = {tensor.name for tensor in reader.tensors}
    hidden_size = arch_field("embedding_length")
    num_heads = arch_field("attention.head_count")
    num_kv_heads = arch_field("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # some files store it per layer
        if len(set(num_kv_heads)) != 1:
            raise ValueError(f"GGUF {gguf_file}: a per-layer KV head count {num_kv_heads} is not supported")
        num_kv_heads = num_kv_heads[0]

    # Qwen3's heads are wider than hidden_size / num_heads; GGUF says so in attention.key_length.
    # llama only writes rope.dimension_count, which equals head_dim there (full rotary).
    head_dim = arch_field("attention.key_length", None)
    if head_dim is None and arch == "llama":
        head_dim = arch_field("rope.dimension_count", None)
    if head_dim is None:
        head_dim = hidden_size // num_heads

    rope_theta = arch_field("rope.freq_base", None)
    if rope_theta is None:
        rope_theta = 10000.0
        logger.warning("GGUF %s has no %s.rope.freq_base; assuming rope_theta=10000", gguf_file, arch)
    scaling = arch_field("rope.scaling.type", "none")
    if scaling not in ("none", "") or "rope_freqs.weight" in tensor_names:
        # Wrong RoPE gives plausible-looking but wrong logits, so refuse rather than guess.
        raise NotImplementedError(
            f"GGUF {gguf_file} uses RoPE scaling ({scaling!r}, rope_freqs tensor: "
            f"{'rope_freqs.weight' in tensor_names}), which atom's GGUF reader does not reproduce; "
            "use the Hugging Face safetensors checkpoint of this model instead"
        )

    vocab_size = arch_field("vocab_size", None)
    if vocab_size is None:
        vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)

    fields = dict(
        architectures=[hf_arch],
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=arch_field("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=arch_field("context_length"),
        rms_norm_eps=arch_field("attention.layer_norm_rms_epsilon"),
        rope_theta=float(rope_theta),
        hidden_act="silu",
        # llama.cpp's converter drops lm_head when it is the embedding matrix.
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id", None),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id", None),
    )
    if arch == "llama":
        fields["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        fields["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    if arch == "qwen3moe":
        moe_size = arch_field("expert_feed_forward_length")
        fields.update(
            num_experts=arch_field("expert_count"),
            num_experts_per_tok=arch_field("expert_used_count"),
            moe_intermediate_size=moe_size,
            intermediate_size=arch_field("feed_forward_length", moe_size),
            # llama.cpp's qwen3moe graph always renormalizes the top-k router weights.
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    else:
        fields["intermediate_size"] = arch_field("feed_forward_length")

    config = AutoConfig.for_model(model_type, **fields)
    # transformers 5 folds rope_theta into config.rope_parameters and drops the attribute; a config
    # saved that way and read by transformers 4 (or code using config.rope_theta) falls back to
    # 10000. Keeping both makes config.json carry both keys too.
    config.rope_theta = float(rope_theta)
    logger.info(
        "GGUF config: %s, %d layers, hidden %d, %d heads / %d KV heads, head_dim %d, vocab %d, rope_theta %g",
        hf_arch,
        fields["num_hidden_layers"],
        hidden_size,
        num_heads,
        num_kv_heads,
        head_dim,
        vocab_size,
        rope_theta,
    )
    return config


def load_gguf_tokenizer(gguf_file: str):
    """A fast tokenizer built from the GGUF vocabulary, with the file's chat template.

    Whether it prepends a BOS follows ``tokenizer.ggml.add_bos_token`` (llama.cpp's rule: default on
    only for SentencePiece vocabularies); SmolLM2 and Qwen say no.
    """
    # PreTrainedTokenizerFast rather than AutoTokenizer: AutoTokenizer first rebuilds the model config
    # from the file (seconds of extra parsing) only to pick the class, which is this one anyway.
    from transformers import PreTrainedTokenizerFast

    start = time.perf_counter()
    directory, name = os.path.split(os.path.abspath(gguf_file))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=name)

    reader = _reader(gguf_file)
    template = _field(reader, "tokenizer.chat_template", None)
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    if not tokenizer.chat_template:
        logger.warning("GGUF %s has no chat template", gguf_file)
    sentencepiece = _field(reader, "tokenizer.ggml.model", None) == "llama"
    _set_add_bos(tokenizer, bool(_field(reader, "tokenizer.ggml.add_bos_token", sentencepiece)))
    logger.info("GGUF tokenizer: %d tokens, loaded in %.2f s", len(tokenizer), time.perf_counter() - start)
    return tokenizer


def _set_add_bos(tokenizer, add_bos: bool) -> None:
    # Which post-processor a GGUF-built tokenizer gets depends on the transformers version (some add
    # a BOS whatever the file says), so check the behaviour and rebuild the post-processor if wrong.
    # A stray BOS shifts every prompt and visibly degrades small models like SmolLM2.
    from tokenizers import processors

    if hasattr(tokenizer, "add_bos_token"):
        tokenizer.add_bos_token = add_bos
    if tokenizer.bos_token is None:
        add_bos = False
    expected = tokenizer("a", add_special_tokens=False).input_ids
    if add_bos:
        expected = [tokenizer.bos_token_id] + expected
    if tokenizer("a").input_ids == expected:
        return
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0" if add_bos else "$A:0",
        pair=f"{bos}:0 $A:0 {bos}:1 $B:1" if add_bos else "$A:0 $B:1",
        special_tokens=[(bos, tokenizer.bos_token_id)] if add_bos else [],
    )
    if tokenizer("a").input_ids != expected:
        raise RuntimeError(f"could not make the GGUF tokenizer {'add' if add_bos else 'skip'} the BOS token")


def _undo_llama_qk_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # llama.cpp's convert_hf_to_gguf.py reorders each head's q/k rows from HF's "two rotary halves"
    # layout (head, 2, dim/2) to interleaved pairs (head, dim/2, 2) for its RoPE kernel. Swap back,
    # exactly as transformers' LlamaTensorProcessor does. Works for weights and biases alike.
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _dequantize(tensor, dtype: torch.dtype) -> torch.Tensor:
    import gguf

    values = gguf.dequantize(tensor.data, tensor.tensor_type)  # float32, except F32/F16 passed through
    # GGUF lists dimensions fastest-moving first; torch wants them the other way round.
    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    values = np.ascontiguousarray(values).reshape(shape)
    if not values.flags.writeable:  # an F32 tensor comes back as a read-only view of the mmap
        values = values.copy()
    return torch.from_numpy(values).to(dtype)


def iter_gguf_weights(gguf_file: str, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight of the GGUF file, dequantized to ``dtype``.

    Names are those of a Hugging Face checkpoint (``model.layers.0.self_attn.q_proj.weight``); a tied
    ``lm_head.weight`` is not yielded (the config says ``tie_word_embeddings``), as in HF checkpoints.
    """
    reader = _reader(gguf_file)
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported by atom")
    num_heads = _field(reader, f"{arch}.attention.head_count")
    num_kv_heads = _field(reader, f"{arch}.attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        num_kv_heads = num_kv_heads[0]
    # Only llama-architecture files carry the q/k permutation; llama.cpp's qwen converters store
    # the HF layout as is.
    permuted = arch == "llama"

    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    logger.info(
        "Loading %d GGUF tensors from %s (%s) as %s",
        len(reader.tensors),
        gguf_file,
        ", ".join(f"{n} {t}" for t, n in types.most_common()),
        dtype,
    )
    start = time.perf_counter()
    name = os.path.basename(gguf_file)
    for tensor in tqdm(reader.tensors, desc=f"Dequantizing {name}", unit="tensor"):
        if tensor.name in _GLOBAL_TENSORS:
            yield _GLOBAL_TENSORS[tensor.name], _dequantize(tensor, dtype)
            continue
        match = _LAYER_NAME.match(tensor.name)
        if match is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no Hugging Face equivalent known to atom")
        layer, part, kind = match.groups()
        prefix = f"model.layers.{layer}"
        if part in _EXPERT_TENSORS:
            stacked = _dequantize(tensor, dtype)
            for expert in range(stacked.shape[0]):
                # clone: a view would keep the whole stack alive and share storage (safetensors refuses that)
                yield f"{prefix}.mlp.experts.{expert}.{_EXPERT_TENSORS[part]}.{kind}", stacked[expert].clone()
            continue
        if part not in _LAYER_TENSORS:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no Hugging Face equivalent known to atom")
        weight = _dequantize(tensor, dtype)
        if permuted and part == "attn_q":
            weight = _undo_llama_qk_permute(weight, num_heads)
        elif permuted and part == "attn_k":
            weight = _undo_llama_qk_permute(weight, num_kv_heads)
        yield f"{prefix}.{_LAYER_TENSORS[part]}.{kind}", weight
    logger.info("Dequantized %s in %.2f s", name, time.perf_counter() - start)


def save_gguf_as_hf(gguf_file: str, out_dir: str, dtype: torch.dtype = torch.float32) -> None:
    """Write the GGUF model as a Hugging Face directory: config.json, model.safetensors, tokenizer.

    float32 (the default) keeps the dequantized values exact. The directory loads with
    ``AutoConfig/AutoTokenizer/AutoModelForCausalLM.from_pretrained(out_dir)`` under transformers 4 and 5.
    Built from this module's own pieces rather than by saving a GGUF-loaded transformers model, which
    refuses to save ("The model is quantized with gguf and is not serializable").
    """
    from safetensors.torch import save_file

    config = load_gguf_config(gguf_file)
    tokenizer = load_gguf_tokenizer(gguf_file)
    weights = dict(iter_gguf_weights(gguf_file, dtype))

    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _make_tokenizer_config_portable(out_dir, tokenizer)
    logger.info(
        "Wrote %s as a Hugging Face checkpoint to %s in %.2f s", gguf_file, out_dir, time.perf_counter() - start
    )


def _make_tokenizer_config_portable(out_dir: str, tokenizer) -> None:
    # transformers 5 names the class "TokenizersBackend", which transformers 4 does not know, and puts
    # the chat template in chat_template.jinja only. The generic fast-tokenizer class and an inline
    # template load everywhere; tokenizer.json already holds the (BOS-free) post-processor.
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        tokenizer_config = json.load(f)
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if tokenizer.chat_template:
        tokenizer_config["chat_template"] = tokenizer.chat_template
    with open(path, "w") as f:
        json.dump(tokenizer_config, f, indent=2, ensure_ascii=False)
