"""atom's multi-head latent attention (DeepSeek-V2/V3) inside vLLM.

Each atom MLA layer gets a ``VllmMLAAttention``: vLLM's own ``MLAAttention`` layer, built with
``attn_backend=ATOMMLABackend``. vLLM sizes and pages its latent cache as for its own MLA
models (``MLAAttentionSpec``: one row of ``kv_lora_rank + rope`` values per token, no heads;
``[num_blocks, block_size, kv_lora_rank + rope]`` once bound, atom's latent-cache layout), and
its MLA custom ops (the graph's splitting points) call ``ATOMMLAImpl``: the cache write with
``ops.store_kv_cache``, then ``atom.layers.mla.latent_attention`` (``ops.mla_decode`` for decode
rows, ``mla_prefill`` for prompt rows) with the metadata of ``ATOMAttentionMetadataBuilder``.

``--kv-cache-dtype fp8`` (or ``fp8_e4m3``): vLLM allocates the latent cache as bytes and passes
the layer's ``_k_scale`` (the checkpoint's ``k_scale``, copied from atom's layer after loading,
else 1.0) to the cache write; atom reads the bytes as e4m3 and stores and reads rows divided by
that scale, as atom's own fp8 latent cache does.

Imported only when a DeepSeek model is built.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.model_executor.layers.attention import MLAAttention
from vllm.v1.attention.backend import AttentionImpl

from atom import ops
from atom.layers.mla import latent_attention
from atom.plugin.vllm.attention import ATOMAttentionBackend, ATOMAttentionMetadata, use_atom_kv_scales


class ATOMMLABackend(ATOMAttentionBackend):
    """atom's latent attention over vLLM's MLA cache (same metadata as ``ATOMAttentionBackend``)."""

    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"]

    @staticmethod
    def get_impl_cls() -> type[ATOMMLAImpl]:
        return ATOMMLAImpl

    # vLLM 0.26 sizes the cache with it (0.32: the MLA spec and the layouts); both bind
    # [num_blocks, block_size, head_size] to the layer
    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (num_blocks, block_size, head_size)

    @classmethod
    def is_mla(cls) -> bool:
        return True


class ATOMMLAImpl(AttentionImpl[ATOMAttentionMetadata]):
    """Called by ``VllmMLAAttention`` with vLLM's MLA arguments: ``q`` [T, H, nope + rope] and
    ``k_pe`` [T, 1, rope] rotated, ``kv_c_normed`` [T, kv_lora_rank]."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes,
                 sliding_window, kv_cache_dtype: str, logits_soft_cap, attn_type: str,
                 kv_sharing_target_layer_name, **mla_args) -> None:
        if kv_cache_dtype not in ATOMMLABackend.supported_kv_cache_dtypes:
            raise NotImplementedError(
                f"atom's multi-head latent attention (DeepSeek) inside vLLM does not support KV cache dtype "
                f"{kv_cache_dtype} yet; use --kv-cache-dtype auto or fp8, or set ATOM_DISABLE_VLLM_PLUGIN=1"
            )
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads, self.kv_cache_dtype = 1, kv_cache_dtype
        self.v_head_dim, self.kv_b_proj = mla_args["v_head_dim"], mla_args["kv_b_proj"]
        # what vLLM's MLA layer asks of its impl: no decode context parallelism
        self.dcp_world_size = 1
        self.is_sparse = False
        self.supports_quant_query_input = False

    def _cache(self, kv_cache: torch.Tensor, k_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(latent cache, its scale); an fp8 cache comes as bytes and is read as e4m3."""
        if not self.kv_cache_dtype.startswith("fp8"):
            return kv_cache, None
        return kv_cache.view(torch.float8_e4m3fn), k_scale

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor) -> None:
        if kv_cache.numel() == 0:  # memory-profiling run
            return
        cache, scale = self._cache(kv_cache, k_scale)
        n = slot_mapping.shape[0]
        latent = torch.cat((kv_c_normed[:n], k_pe[:n, 0]), dim=-1).unsqueeze(1)
        # the latent row is MLA's key and its value: one [num_blocks, 1, block_size, r + rope]
        # cache as both, written twice with the same row (and scale)
        cache = cache.unsqueeze(1)
        ops.store_kv_cache(latent, latent, cache, cache, slot_mapping, scale, scale)

    def forward(self, layer, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: ATOMAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:  # fmt: skip
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("atom's attention backend does not fuse output quantization")
        if attn_metadata is None:  # profiling / warm-up run: no cache yet
            return output
        m = attn_metadata
        n = m.num_actual_tokens
        # the builder splits off decode rows only in mixed batches
        num_decodes = n if m.max_query_len == 1 else m.num_decode_tokens
        cache, k_scale = self._cache(kv_cache, layer._k_scale)
        # short queries (vLLM's speculative verify rows) run as decode rows over their causal prefix
        host = (m.query_start_loc_cpu, m.seq_lens_cpu) if m.seq_lens_cpu is not None else None
        out = output[:n].view(n, -1, self.v_head_dim)  # written in place: no copy of the result
        latent_attention(q[:n], kv_c_normed[:n], k_pe[:n, 0], cache, m.query_start_loc, m.seq_lens, m.block_table,
                         num_decodes, self.kv_b_proj.weight, self.scale, self.v_head_dim, k_scale, m.max_query_len,
                         host, out)  # fmt: skip
        return output


class VllmMLAAttention(MLAAttention):
    """vLLM's MLA layer (cache spec, custom ops, graph splitting), run by ``ATOMMLAImpl``."""

    def forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, *args, **kwargs) -> torch.Tensor:
        return self.impl.forward(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, *args, **kwargs)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        # atom reads kv_b_proj's weight as loaded: no absorbed copies to make; the checkpoint's
        # k_scale is on atom's layer
        use_atom_kv_scales(self)
