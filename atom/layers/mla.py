"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

Each token's cache entry is one row ``cat(c_kv, k_pe)`` of ``kv_lora_rank + rope_dim``
values shared by all heads (see ``atom.ops.mla``), paged with the same block tables as
ordinary attention; the model runner sizes the cache from ``kv_cache_shape``, so MLA fits
``heads * (qk_head_dim + v_head_dim) / (kv_lora_rank + rope_dim)`` times more tokens than
per-head K/V (about 71x for DeepSeek-V3). With ``--kv_cache_dtype fp8`` the rows are e4m3, divided
by the layer's ``k_scale`` (the checkpoint's, else 1.0; loaded like ``Attention``'s), as in vLLM.

- Prompt rows (prefill, chunked prefill, a cached prefix) expand their sequence's latents to
  per-head keys and values through ``kv_b_proj`` and attend as usual.
- Decode rows absorb ``W_UK`` (the key half of ``kv_b_proj``) into the query and ``W_UV``
  (the value half) into the output, so the kernel reads only the latent rows
  (``ops.mla_decode``).
- Batches whose sequences all bring a few rows (MTP verification: ``K + 1`` rows each) run every
  row as a decode row over its causal prefix of the cache (vLLM's layout for spec decode): one
  kernel for the batch, no per-sequence expansion, and each row the numbers plain decoding gives.

As with ``Attention``, the whole layer is one opaque custom op (``atom::mla_attention``) for
torch.compile, and the batch's metadata comes from the forward context. In plugin mode the
host's MLA layer owns the cache and the metadata (``attach_host_attention``): this layer applies
RoPE, and the host's backend runs ``latent_attention`` (``atom.plugin.vllm.mla``).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from atom import ops
from atom.forward_context import get_forward_context
from atom.layers.attention import Attention
from atom.layers.layernorm import RMSNorm
from atom.layers.rotary_embedding import RotaryEmbedding
from atom.ops.mla import mla_prefill, mla_prefill_attention


class MLAAttention(Attention):
    def __init__(
        self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, kv_lora_rank: int,
        scale: float, interleaved: bool, prefix: str = "",
    ):  # fmt: skip
        # one "KV head" of the latent width: the runner's cache accounting sees one row per token
        super().__init__(num_heads, kv_lora_rank + qk_rope_head_dim, scale, 1, prefix)
        self.nope, self.rope, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.kv_lora_rank, self.interleaved = kv_lora_rank, interleaved
        self.kv_cache: torch.Tensor | None = None  # [num_blocks, block_size, kv_lora_rank + rope]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.head_dim)

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        self.kv_cache = cache

    def attach_host_attention(self, layer: nn.Module) -> None:
        """Plugin mode: ``layer`` (vLLM's ``MLAAttention``) gets the rotated query, the latent and
        the rotated ``k_pe`` as vLLM's own DeepSeek passes them."""
        self.host_attention = layer

    def forward(  # type: ignore[override]
        self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
        rotary_emb: RotaryEmbedding, kv_b_weight: torch.Tensor, kv_norm: RMSNorm,
    ) -> torch.Tensor:  # fmt: skip
        """``q`` [T, heads * (nope + rope)], ``kv_c`` [T, kv_lora_rank] (not normed yet: ``kv_norm``
        norms it, in decode steps inside the rope and cache-write kernel), ``k_pe`` [T, rope] (not
        rotated yet), ``kv_b_weight`` [heads * (nope + v), kv_lora_rank].
        Returns [T, heads * v_head_dim], the input of ``o_proj``."""
        q = q.view(q.shape[0], self.num_heads, self.nope + self.rope)
        if self.host_attention is not None:
            kv_c = kv_norm(kv_c)
            q, k_pe = ops.mla_rope_store(q, kv_c, k_pe, positions, rotary_emb.cos_sin_cache, None, None,
                                         self.interleaved)  # fmt: skip
            return self.host_attention(q, kv_c, k_pe.unsqueeze(1),
                                       output_shape=(q.shape[0], self.num_heads * self.v_head_dim))
        out = q.new_empty(q.shape[0], self.num_heads * self.v_head_dim)
        torch.ops.atom.mla_attention(q, kv_c, k_pe, out, positions, rotary_emb.cos_sin_cache, kv_b_weight,
                                     kv_norm.weight, kv_norm.eps, self.prefix)  # fmt: skip
        return out

    def run_mla(self, q, kv_c, k_pe, out, positions, cos_sin_cache, kv_b_weight, norm_weight, norm_eps) -> None:
        """As ``Attention.run``: the metadata's tokens (the first rows of maybe padded inputs)
        into the same rows of ``out``."""
        meta = get_forward_context().attn_metadata
        n = meta.slot_mapping.shape[0]
        q, kv_c, k_pe, positions = q[:n], kv_c[:n], k_pe[:n], positions[:n]
        slots = meta.slot_mapping if self.kv_cache is not None else None
        # the memory-profiling run has no cache: every row is a prompt row there
        num_decodes = meta.num_decode_tokens if self.kv_cache is not None else 0
        out = out[:n].view(n, self.num_heads, self.v_head_dim)
        if num_decodes == n > 0:
            # decode step: the rotated rope columns go straight into the decode kernel's query,
            # whose latent columns the absorption fills (no concatenation); q keeps the nope ones
            rank = self.kv_lora_rank
            decode_q = q.new_empty(n, self.num_heads, rank + self.rope)
            k_pe = ops.mla_rope_store_into(decode_q[..., rank:], q, kv_c, k_pe, positions, cos_sin_cache,
                                           self.kv_cache, slots, self.interleaved, self.k_scale,
                                           kv_norm=(norm_weight, norm_eps))  # fmt: skip
            latent_decode(q, decode_q, self.kv_cache, meta.seq_lens, meta.block_tables, kv_b_weight, self.scale,
                          self.k_scale, out)  # fmt: skip
            return
        kv_c = ops.unwrapped("rms_norm", q.device)(kv_c, norm_weight, norm_eps)  # prompt rows read it
        store = ops.unwrapped("mla_rope_store", q.device)  # already inside the opaque op
        q, k_pe = store(q, kv_c, k_pe, positions, cos_sin_cache, self.kv_cache, slots, self.interleaved, self.k_scale)
        host = (meta.cu_seqlens_q_cpu, meta.seq_lens_cpu) if meta.seq_lens_cpu is not None else None
        latent_attention(q, kv_c, k_pe, self.kv_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                         num_decodes, kv_b_weight, self.scale, self.v_head_dim, self.k_scale, meta.max_seqlen_q,
                         host, out)  # fmt: skip


# sequences bringing at most this many rows (MTP's K + 1) run them as decode rows
SHORT_QUERY = 8
# whole prompts through ops.mla_prefill_attention (atom's Triton kernel on a GPU: one launch for
# the step) rather than torch's SDPA once per sequence; ATOM_MLA_TRITON_PREFILL=0 keeps SDPA
# (DeepSeek-V2-Lite throughput 9,498 vs 7,495 tok/s on an H200: docs/performance.md, session 21)
TRITON_PREFILL = os.environ.get("ATOM_MLA_TRITON_PREFILL", "1") == "1"


def latent_attention(
    q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, num_decodes: int,
    kv_b_weight: torch.Tensor, scale: float, v_head_dim: int, k_scale: torch.Tensor | None = None,
    max_query_len: int | None = None, host_lens: tuple[list[int], list[int]] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Attention over the latent cache (this step's rows already written), shared by atom's
    engine and its vLLM backend. ``q`` [T, H, nope + rope] (rotated), the first
    ``num_decodes`` rows one decode token each; ``kv_c`` [T, r] and ``k_pe`` [T, rope] (rotated):
    this step's latents (read only by prompt rows); ``kv_b_weight`` [H * (nope + v), r]; ``k_scale``: an fp8 cache's
    scale; ``max_query_len``: the most rows a sequence brings (when known; up to
    ``SHORT_QUERY`` every row runs as a decode row); ``host_lens``: ``cu_seqlens_q`` and
    ``seq_lens`` as host lists, where the caller has them (the prompt rows then need no device
    sync); ``out``: where the result goes (a [T, H, v] view of the caller's output, as vLLM's
    MLA writes its up-projection), else a new tensor. Returns it, [T, H, v]."""
    num_tokens, num_heads = q.shape[:2]
    rank, nope = kv_b_weight.shape[1], q.shape[-1] - k_pe.shape[-1]
    out = q.new_empty(num_tokens, num_heads, v_head_dim) if out is None else out

    def absorbed(rows: slice, lens: torch.Tensor, tables: torch.Tensor) -> None:
        decode_q = q.new_empty(q[rows].shape[0], num_heads, rank + k_pe.shape[-1])
        decode_q[..., rank:] = q[rows, :, nope:]  # the rotated rope columns; the absorption fills the rest
        latent_decode(q[rows], decode_q, kv_cache, lens, tables, kv_b_weight, scale, k_scale, out[rows])

    if num_decodes:
        d = slice(0, num_decodes)
        absorbed(d, seq_lens[d], block_tables[d])
    if num_decodes < num_tokens:
        p = slice(num_decodes, None)
        cu = cu_seqlens_q[num_decodes:] - num_decodes
        if kv_cache is not None and max_query_len is not None and max_query_len <= SHORT_QUERY:
            absorbed(p, *causal_rows(cu, seq_lens[p], block_tables[p], num_tokens - num_decodes))
        else:
            attend = ops.mla_prefill_attention if TRITON_PREFILL else mla_prefill_attention
            if host_lens is not None:  # the prompt rows' share, as ``cu`` and ``seq_lens[p]``
                host_cu, host_seq = host_lens
                host_lens = ([c - num_decodes for c in host_cu[num_decodes:]], host_seq[num_decodes:])
            latents = torch.cat((kv_c[p], k_pe[p]), dim=-1)
            out[p] = mla_prefill(q[p], kv_cache, latents, cu, seq_lens[p], block_tables[p], kv_b_weight, scale,
                                 v_head_dim, k_scale, attend, host_lens)  # fmt: skip
    return out


def latent_decode(
    q: torch.Tensor, decode_q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, kv_b_weight: torch.Tensor, scale: float, k_scale: torch.Tensor | None,
    out: torch.Tensor,
) -> None:  # fmt: skip
    """Decode rows with the up-projections absorbed: ``q``'s nope columns [B, H, nope] times
    ``W_UK`` into ``decode_q``'s first r columns (its last rope columns already hold the rotated
    ``q_pe``), the kernel over the latent rows, then ``W_UV`` into ``out`` [B, H, v]. Both
    products write through strided ``out=`` views (cuBLAS takes their leading dimensions), so
    neither the query nor the result is copied."""
    num_heads, kv_lora_rank = q.shape[1], kv_b_weight.shape[1]
    v_head_dim = out.shape[-1]
    nope = kv_b_weight.shape[0] // num_heads - v_head_dim
    w = kv_b_weight.view(num_heads, nope + v_head_dim, kv_lora_rank)
    torch.bmm(q[..., :nope].transpose(0, 1), w[:, :nope], out=decode_q[..., :kv_lora_rank].transpose(0, 1))
    # latent_attention runs inside an opaque op (atom's or vLLM's): the kernel, not its custom op
    decode = ops.unwrapped("mla_decode", q.device)
    o_lat = decode(decode_q, kv_cache, seq_lens, block_tables, scale, kv_lora_rank, k_scale)
    torch.bmm(o_lat.transpose(0, 1), w[:, nope:].transpose(1, 2), out=out.transpose(0, 1))


def causal_rows(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each query row as a decode row: the tokens it sees (its sequence's length less the rows
    after it) and its sequence's block table; computed on the device, no host sync."""
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    seq = torch.repeat_interleave(torch.arange(len(q_lens), device=q_lens.device), q_lens, output_size=num_rows)
    rows_after = cu_seqlens_q[1:][seq] - 1 - torch.arange(num_rows, device=q_lens.device)
    return (seq_lens[seq] - rows_after).to(seq_lens.dtype), block_tables[seq]


@torch.library.custom_op("atom::mla_attention", mutates_args=("out",))
def mla_attention(
    q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, out: torch.Tensor, positions: torch.Tensor,
    cos_sin_cache: torch.Tensor, kv_b_weight: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float,
    layer_name: str,
) -> None:  # fmt: skip
    """Writes ``out`` [T, heads * v_head_dim] and, as a side effect, the layer's latent cache
    (the layer is found by name in the forward context); ``kv_c`` is normed here
    (``norm_weight``, ``norm_eps``)."""
    layer = get_forward_context().attn_layers[layer_name]
    layer.run_mla(q, kv_c, k_pe, out, positions, cos_sin_cache, kv_b_weight, norm_weight, norm_eps)


@mla_attention.register_fake
def _(q, kv_c, k_pe, out, positions, cos_sin_cache, kv_b_weight, norm_weight, norm_eps, layer_name) -> None:
    return None
