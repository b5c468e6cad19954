"""Triton kernels behind ``atom.ops``; each public name matches a function of
``atom.ops.reference`` and has the same signature and semantics."""

from atom.ops.triton.activation import silu_and_mul
from atom.ops.triton.attention import paged_attention
from atom.ops.triton.mla import mla_decode, mla_rope_store
from atom.ops.triton.mla_prefill import mla_prefill_attention
from atom.ops.triton.moe import fused_moe, grouped_topk, moe_topk
from atom.ops.triton.norm import rms_norm
from atom.ops.triton.rope_cache import qk_norm_rope_store, rotary_embedding, store_kv_cache
from atom.ops.triton.sampling import top_k_top_p_min_p
from atom.ops.triton.sampling_fused import sample_tokens

__all__ = [
    "fused_moe",
    "mla_decode",
    "mla_prefill_attention",
    "mla_rope_store",
    "moe_topk",
    "grouped_topk",
    "paged_attention",
    "qk_norm_rope_store",
    "rms_norm",
    "rotary_embedding",
    "sample_tokens",
    "silu_and_mul",
    "store_kv_cache",
    "top_k_top_p_min_p",
]
