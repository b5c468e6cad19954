"""Attention over the paged KV cache.

The layer gets q/k/v straight from the QKV projection and does the rest in one opaque op,
``torch.ops.atom.unified_attention``: per-head q/k RMSNorm (Qwen3), RoPE and the KV-cache
write as one fused kernel, then paged attention with the batch's metadata from the forward
context. Being one custom op, it is where torch.compile splits the graph, and where the
piecewise CUDA graphs of mixed batches split it (``atom.worker.piecewise``): so the op
writes into an output the layer allocates before it (vLLM's ``unified_attention_with_output``),
which a captured piece then owns, and it attends only the batch's real tokens, the
metadata's, of inputs that may be padded to a captured size. In plugin mode
a host attention layer is attached (``attach_host_attention``) and gets the rotated q/k/v
instead: the host framework owns the cache and the metadata.
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
        # an fp8 cache's per-tensor scales (the checkpoint's k_scale/v_scale, else 1.0)
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """This layer's slice of the KV cache; the model runner allocates ``[layers, *shape]``."""
        return (2, num_blocks, self.num_kv_heads, block_size, self.head_dim)

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = cache[0], cache[1]

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
        qw = q_norm.weight if q_norm is not None else None
        kw = k_norm.weight if k_norm is not None else None
        eps = q_norm.eps if q_norm is not None else 0.0
        if self.host_attention is not None:
            q, k = ops.qk_norm_rope_store(self._heads(q, self.num_heads), self._heads(k), self._heads(v), qw, kw,
                                          eps, positions, rotary_emb.cos_sin_cache, None, None, None)
            return self.host_attention(q.flatten(1), k.flatten(1), v)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        torch.ops.atom.unified_attention(q, k, v, out, positions, rotary_emb.cos_sin_cache, qw, kw, eps, self.prefix)
        return out

    def _heads(self, x: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        return x.reshape(x.shape[0], num_heads or self.num_kv_heads, self.head_dim)

    def run(self, q, k, v, out, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps: float) -> None:
        """Attention of the metadata's tokens, the first rows of the (maybe padded) inputs,
        into the same rows of ``out``."""
        meta = get_forward_context().attn_metadata
        n = meta.slot_mapping.shape[0]
        q, k, v = self._heads(q[:n], self.num_heads), self._heads(k[:n]), self._heads(v[:n])
        positions, out = positions[:n], out[:n].view(n, self.num_heads, self.head_dim)
        store = ops.unwrapped("qk_norm_rope_store", q.device)  # already inside the opaque op
        q, k = store(q, k, v, q_norm_weight, k_norm_weight, eps, positions, cos_sin_cache, self.k_cache, self.v_cache,
                     meta.slot_mapping, self.k_scale, self.v_scale)
        if self.k_cache is None:  # memory-profiling run: prompts only, no cache yet
            _prompt_attention(q, k, v, out, meta.cu_seqlens_q, self.scale)
        else:
            ops.paged_attention_into(out, q, self.k_cache, self.v_cache, meta.cu_seqlens_q, meta.seq_lens,
                                     meta.block_tables, self.scale, meta.max_seqlen_q, meta.max_seqlen_k,
                                     meta.num_decode_tokens, k, v, self.k_scale, self.v_scale)


@torch.library.custom_op("atom::unified_attention", mutates_args=("out",))
def unified_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, positions: torch.Tensor,
    cos_sin_cache: torch.Tensor, q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
    layer_name: str,
) -> None:
    """Writes ``out`` [T, heads * head_dim] and, as a side effect, the layer's KV cache (the
    layer is found by name in the forward context)."""
    ctx = get_forward_context()
    ctx.attn_layers[layer_name].run(q, k, v, out, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps)


@unified_attention.register_fake
def _(q, k, v, out, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, layer_name) -> None:
    return None


def _prompt_attention(q, k, v, out: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float) -> None:
    """The memory profile's attention (no cache yet), into ``out``. Batched 4-D inputs with
    grouped heads let SDPA pick its flash kernel, whose memory, like atom's kernels', does not
    grow with the square of the prompt: its math fallback (3-D inputs) held 1 GiB per 4,096-token
    prompt and head group, which the KV cache lost."""
    cu = cu_seqlens_q.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        qi, ki, vi = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
