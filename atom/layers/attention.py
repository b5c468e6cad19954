"""Attention over the paged KV cache.

The layer gets q/k/v straight from the QKV projection and does the rest: per-head
q/k RMSNorm (Qwen3), RoPE and the KV-cache write as one op, then paged attention, with
the batch's metadata taken from the forward context. In plugin mode a host attention
layer is attached (``attach_host_attention``) and gets the rotated q/k/v instead: the
host framework owns the cache and the metadata.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom import ops
from atom.forward_context import get_forward_context
from atom.layers.layernorm import RMSNorm
from atom.layers.rotary_embedding import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, prefix: str = ""):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.prefix = prefix
        # set by the model runner once the cache is allocated: [num_blocks, Hk, block_size, D]
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.host_attention: nn.Module | None = None

    def attach_host_attention(self, layer: nn.Module) -> None:
        self.host_attention = layer

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        rotary_emb: RotaryEmbedding,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        qw = q_norm.weight if q_norm is not None else None
        kw = k_norm.weight if k_norm is not None else None
        eps = q_norm.eps if q_norm is not None else 0.0
        if self.host_attention is not None:
            q, k = ops.qk_norm_rope_store(q, k, v, qw, kw, eps, positions, rotary_emb.cos_sin_cache,
                                          None, None, None)
            return self.host_attention(q.flatten(1), k.flatten(1), v.flatten(1))
        meta = get_forward_context().attn_metadata
        q, k = ops.qk_norm_rope_store(q, k, v, qw, kw, eps, positions, rotary_emb.cos_sin_cache,
                                      self.k_cache, self.v_cache, meta.slot_mapping)
        if self.k_cache is None:  # memory-profiling run: prompts only, no cache yet
            o = _prompt_attention(q, k, v, meta.cu_seqlens_q, self.scale)
        else:
            o = ops.paged_attention(q, self.k_cache, self.v_cache, meta.cu_seqlens_q, meta.seq_lens,
                                    meta.block_tables, self.scale, meta.max_seqlen_q, meta.max_seqlen_k)
        return o.flatten(1)


def _prompt_attention(q, k, v, cu_seqlens_q: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    cu = cu_seqlens_q.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        qi, ki, vi = (t[start:end].transpose(0, 1) for t in (q, k, v))
        ki, vi = ki.repeat_interleave(group, 0), vi.repeat_interleave(group, 0)
        out[start:end] = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale).transpose(0, 1)
    return out
