"""atom's attention backend for vLLM: vLLM builds the batch metadata and owns the KV cache,
atom's kernels (``atom.ops``: Triton on a GPU, the PyTorch reference on the CPU) write the new
keys/values and run paged attention.

KV cache: vLLM gives each layer one tensor of logical shape
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, keys and values side by side in the
last dim (as for vLLM's own backends). ``kv[..., :D]`` and ``kv[..., D:]`` are atom's
``[num_blocks, num_kv_heads, block_size, head_dim]`` key and value caches with a token stride
of ``2 * D``; atom's ops index caches by their strides, so any physical order vLLM picks works.
Head-major ("HND", vLLM 0.32's ``LBHNC``) is asked for first: atom's own layout, in which the
keys of one (block, KV head) are one strided tile.

``--kv-cache-dtype fp8`` (or ``fp8_e4m3``): vLLM allocates the cache as bytes; atom reads it as
e4m3 and quantises/dequantises with the layer's ``_k_scale``/``_v_scale``: the checkpoint's
``k_scale``/``v_scale`` (atom's loader puts them on atom's layer, ``use_atom_kv_scales`` copies
them onto vLLM's after loading), else 1.0.

Multi-head latent attention (DeepSeek): ``atom.plugin.vllm.mla``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from atom import ops

try:  # vLLM >= 0.32 describes the physical layout with KVCacheLayout
    from vllm.v1.kv_cache_layout import KVCacheLayout
except ImportError:  # vLLM 0.26: get_kv_cache_shape (+ identity stride order) only
    KVCacheLayout = None


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-layer cache -> atom's (k_cache, v_cache) views, [num_blocks, Hk, block_size, D] each."""
    return kv_cache[..., :head_size], kv_cache[..., head_size:]


class ATOMAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM's slot for an out-of-tree backend (register_attention_backend)

    @staticmethod
    def get_impl_cls() -> type[ATOMAttentionImpl]:
        return ATOMAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[ATOMAttentionMetadataBuilder]:
        return ATOMAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)

    @classmethod
    def supported_kv_cache_layouts(cls):
        if KVCacheLayout is None:
            return None
        return (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)


@dataclass
class ATOMAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [B+1] int32: query rows of each request
    seq_lens: torch.Tensor  # [B] int32: tokens of each request after this step
    block_table: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    num_decode_tokens: int = 0  # mixed batches: rows with q_len == 1, placed first
    # host copies (vLLM's query_start_loc_cpu, and seq_lens where exact): the MLA prompt
    # attention reads its lengths here instead of syncing with the device
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None


class ATOMAttentionMetadataBuilder(AttentionMetadataBuilder[ATOMAttentionMetadata]):
    """Passes vLLM's common metadata through. atom's kernels take mixed prefill/decode batches
    in any order; with decodes first (vLLM reorders the batch for a threshold of 1) the Triton
    kernel gives them decode-sized tiles."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)
        # vLLM's host seq_lens are an upper bound under (async) speculative decoding
        self._exact_host_seq_lens = vllm_config.speculative_config is None

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # The Triton path takes its tile shape from max_query_len and never syncs with the host,
        # so decode-only batches (max_query_len == 1) replay from full CUDA graphs.
        if vllm_config.device_config.device_type == "cuda" and ops.use_triton("cuda"):
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return AttentionCGSupport.NEVER

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> ATOMAttentionMetadata:
        m = common_attn_metadata
        num_decodes, host_cu, host_seq = 0, None, None
        if m.max_query_len > 1:  # from the host copy of the query lengths: no device sync
            num_decodes = split_decodes_and_prefills(m, decode_threshold=1)[0]
            host_seq = getattr(m, "seq_lens_cpu_upper_bound", None) if self._exact_host_seq_lens else None
            if host_seq is not None:
                rows = m.seq_lens.shape[0]  # the device tensors' lengths (padded requests included)
                host_cu, host_seq = m.query_start_loc_cpu[: rows + 1].tolist(), host_seq[:rows].tolist()
        return ATOMAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            num_decode_tokens=num_decodes,
            query_start_loc_cpu=host_cu,
            seq_lens_cpu=host_seq,
        )


class ATOMAttentionImpl(AttentionImpl[ATOMAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra_impl_args,
    ) -> None:
        unsupported = [name for name, present in (
            ("ALiBi", alibi_slopes is not None),
            ("sliding window", sliding_window not in (None, -1)),
            ("logits soft-capping", bool(logits_soft_cap)),
            (f"attention type {attn_type}", attn_type != AttentionType.DECODER),
            (f"KV cache dtype {kv_cache_dtype}", kv_cache_dtype not in ATOMAttentionBackend.supported_kv_cache_dtypes),
            ("attention sinks", extra_impl_args.get("sinks") is not None),
        ) if present]
        if unsupported:
            raise NotImplementedError(
                f"atom's attention backend does not support {', '.join(unsupported)}; "
                "set ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1 to use vLLM's attention with this model"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def _caches(self, layer, kv_cache: torch.Tensor):
        """(k_cache, v_cache, k_scale, v_scale); an fp8 cache comes as bytes and is read as e4m3."""
        if not self.kv_cache_dtype.startswith("fp8"):
            return (*split_kv_cache(kv_cache, self.head_size), None, None)
        if kv_cache.dtype != torch.float8_e4m3fn:
            kv_cache = kv_cache.view(torch.float8_e4m3fn)
        return (*split_kv_cache(kv_cache, self.head_size), layer._k_scale, layer._v_scale)

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        k_cache, v_cache, k_scale, v_scale = self._caches(layer, kv_cache)
        n = slot_mapping.shape[0]
        # inside vLLM's opaque KV-update op already: the kernel itself, not its custom op
        ops.unwrapped("store_kv_cache", key.device)(key[:n], value[:n], k_cache, v_cache, slot_mapping, k_scale,
                                                   v_scale)  # fmt: skip

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: ATOMAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("atom's attention backend does not fuse output quantization")
        if attn_metadata is None:  # profiling / warm-up run: no cache yet
            return output
        m = attn_metadata
        n = m.num_actual_tokens
        k_cache, v_cache, k_scale, v_scale = self._caches(layer, kv_cache)
        # the chunk's own keys and values, which this layer has just written to its cache: the
        # prefill kernel reads their full tiles through tensor descriptors instead of gathering
        # them from the cache, as in atom's engine (not for a layer reading another's cache)
        own = key is not None and value is not None and self.kv_sharing_target_layer_name is None
        k, v = (key[:n], value[:n]) if own else (None, None)
        # inside vLLM's opaque attention op already: the kernel writes vLLM's output buffer
        ops.paged_attention_into(output[:n].view(query[:n].shape), query[:n], k_cache, v_cache, m.query_start_loc,
                                 m.seq_lens, m.block_table, self.scale, m.max_query_len, m.max_seq_len,
                                 m.num_decode_tokens, k, v, k_scale, v_scale)  # fmt: skip
        return output


def use_atom_kv_scales(host) -> None:
    """Give vLLM's layer ``host`` the fp8 cache scales of its atom layer (``host.atom_layer``, a
    weak reference: atom's layer holds the host). atom's loader puts a checkpoint's
    ``k_scale``/``v_scale`` on atom's layer; the backends (atom's, and vLLM's own with
    ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1) read the host's, which vLLM sets to 1.0 after loading
    (it loads no scales itself: the host has no quantisation config)."""
    layer = host.atom_layer()
    k, v = float(layer.k_scale), float(layer.v_scale)
    host._k_scale.fill_(k)
    host._v_scale.fill_(v)
    # vLLM's host-side copies (backends that take the scales as numbers)
    host._k_scale_float, host._v_scale_float = k, v
    host._k_scale_cpu.fill_(k)
    host._v_scale_cpu.fill_(v)


class VllmAttention(Attention):
    """vLLM's ``Attention`` layer with atom's layer's fp8 cache scales (``use_atom_kv_scales``)."""

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        super().process_weights_after_loading(act_dtype)  # sets the scales to 1.0
        use_atom_kv_scales(self)


def register_attention_backend() -> None:
    """Point vLLM's CUSTOM attention backend slot at atom's backend (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    backend = ATOMAttentionBackend
    register_backend(AttentionBackendEnum.CUSTOM, f"{backend.__module__}.{backend.__qualname__}")


register_attention_backend()
