"""atom's model classes with SGLang's model interface (an SGLang external model package).

Each wrapper subclasses atom's model class (same modules, parameter names and ``load_weights``)
and is named after the Hugging Face architecture, which is how SGLang's registry keys it. The
constructor takes SGLang's ``(config, quant_config, prefix)``; ``forward`` takes SGLang's
``forward_batch`` and returns its ``LogitsProcessor`` output. Every atom attention layer gets an
SGLang ``RadixAttention`` (layer id from its name), which SGLang's attention backend runs over
SGLang's KV cache; atom's layer still does q/k-norm and RoPE.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn

from atom.config import sliding_window
from atom.distributed.parallel_state import SINGLE, TPInfo
from atom.layers.attention import Attention as AtomAttention
from atom.models.registry import get_model_class, plugin_architectures
from atom.plugin.sglang import logger

_forward_batch: contextvars.ContextVar = contextvars.ContextVar("atom_sglang_forward_batch", default=None)


class SGLangTP(TPInfo):
    """SGLang's tensor-parallel group, reduced and gathered by SGLang's communicators."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        from sglang.srt.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        from sglang.srt.distributed import tensor_model_parallel_all_gather

        return tensor_model_parallel_all_gather(x.contiguous(), dim)


def sglang_tp() -> TPInfo:
    from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    size = get_tensor_model_parallel_world_size()
    return SINGLE if size == 1 else SGLangTP(get_tensor_model_parallel_rank(), size)


class _RadixHost(nn.Module):
    """atom's host-attention callable: ``(q, k, v)`` [T, H*D] -> RadixAttention with the batch
    SGLang passed to the model's forward."""

    def __init__(self, radix: nn.Module):
        super().__init__()
        self.radix = radix

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch = _forward_batch.get()
        if batch is None:
            raise RuntimeError("atom's SGLang model ran attention outside its forward")
        return self.radix(q, k, v, batch)


def attach_radix_attention(model: nn.Module, prefix: str = "") -> int:
    from sglang.srt.layers.radix_attention import RadixAttention

    layers = [m for m in model.modules() if isinstance(m, AtomAttention)]
    for layer in layers:
        layer_id = int(layer.prefix.split("layers.")[1].split(".")[0])
        layer.attach_host_attention(
            _RadixHost(
                RadixAttention(
                    layer.num_heads,
                    layer.head_dim,
                    layer.scale,
                    layer.num_kv_heads,
                    layer_id,
                    prefix=f"{prefix}.{layer.prefix}" if prefix else layer.prefix,
                )
            )
        )
    return len(layers)


class SGLangModelAdapter:
    """Placed before an atom model class in the wrapper's bases."""

    def __init__(self, config, quant_config=None, prefix: str = "", **kwargs) -> None:
        if quant_config is not None:
            raise NotImplementedError(f"atom's {type(self).__name__} inside SGLang does not support quantization")
        if sliding_window(config) is not None:  # SGLang gives the model no context length to check against
            raise NotImplementedError(f"atom's {type(self).__name__} inside SGLang does not support sliding-window "
                                      "attention; set ATOM_DISABLE_SGLANG_PLUGIN=1 to run SGLang's own implementation")
        super().__init__(config, sglang_tp())
        layers = attach_radix_attention(self, prefix)
        from sglang.srt.layers.logits_processor import LogitsProcessor

        self.logits_processor = LogitsProcessor(config)
        logger.info("atom's %s built for SGLang: %d attention layers on RadixAttention", type(self).__name__, layers)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch,
        input_embeds=None,
        get_embedding: bool = False,
        **kwargs,
    ):
        if get_embedding:
            raise NotImplementedError("atom's models in SGLang generate; embeddings are not supported")
        with _batch(forward_batch):
            hidden_states = super().forward(input_ids, positions, input_embeds)
        return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch)


@contextlib.contextmanager
def _batch(forward_batch):
    token = _forward_batch.set(forward_batch)
    try:
        yield
    finally:
        _forward_batch.reset(token)


def _make_wrapper(arch: str) -> type[nn.Module]:
    base = get_model_class(arch)
    return type(
        arch,
        (SGLangModelAdapter, base),
        {
            "__module__": __name__,
            "__qualname__": arch,
            "__doc__": f"atom's {arch} ({base.__module__}) with SGLang's model interface.",
            "atom_class": base,
        },
    )


WRAPPERS = {arch: _make_wrapper(arch) for arch in plugin_architectures()}
globals().update(WRAPPERS)
