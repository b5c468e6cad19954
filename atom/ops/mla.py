"""Plain PyTorch definitions of the multi-head latent attention (MLA) ops.

MLA's KV cache (per layer) is ``kv_cache [num_blocks, block_size, kv_lora_rank + rope_dim]``:
one "head" per token holding the normalised latent ``c_kv`` followed by the rotated shared
rope key ``k_pe``. It is paged with the same block tables as every other cache (slot
``block_id * block_size + offset``). The Triton kernels of ``atom.ops.triton.mla`` are tested
against the functions of the same name here.

FP8 cache (vLLM's MLA semantics): a ``float8_e4m3fn`` cache holds the whole row divided by one
per-layer float32 scale, ``k_scale`` (``atom.ops.reference.to_cache_dtype``); every reader
multiplies it back (``from_cache``). Other cache dtypes ignore the scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom.ops.reference import from_cache, rotary_embedding, to_cache_dtype


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``(x0, x1), (x2, x3), ...`` pairs -> ``(x0, x2, ..., x1, x3, ...)``: DeepSeek's
    interleaved rope dims in the neox layout. Queries and keys get the same permutation, so
    their dot products (and attention) are unchanged."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def mla_rope_store(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
    interleaved: bool,
    k_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on the last ``rope_dim`` dims of each query head and on the shared ``k_pe``, then
    the cache write of ``cat(kv_c, k_pe)``. ``q``: [T, H, nope + rope]; ``kv_c``: [T, r]
    (already normed); ``k_pe``: [T, rope]. ``interleaved``: the rope dims come in pairs
    (DeepSeek's layout) and leave in the neox layout. Returns (q, k_pe) rotated; a
    negative slot stores nothing. ``k_scale``: an fp8 cache's scale."""
    rope_dim = k_pe.shape[-1]
    q_nope, q_pe = q[..., :-rope_dim], q[..., -rope_dim:]
    k_pe = k_pe.unsqueeze(1)
    if interleaved:
        q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
    q_pe, k_pe = rotary_embedding(positions, q_pe, k_pe, cos_sin_cache)
    k_pe = k_pe.squeeze(1)
    if kv_cache is not None and kv_cache.numel() > 0:
        block_size = kv_cache.shape[1]
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        entry = to_cache_dtype(torch.cat((kv_c[keep], k_pe[keep]), dim=-1), kv_cache.dtype, k_scale)
        kv_cache[slots // block_size, slots % block_size] = entry
    return torch.cat((q_nope, q_pe), dim=-1), k_pe


def _latents(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` latent rows [seq_len, r + rope] of one sequence."""
    block_size = kv_cache.shape[1]
    blocks = block_table[: -(-seq_len // block_size)].long()
    return kv_cache[blocks].reshape(-1, kv_cache.shape[-1])[:seq_len]


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention in the latent space ("weight absorption"). Row ``i`` is the one new
    token of sequence ``i`` (its key is already in the cache). ``q``: [B, H, r + rope], the
    query with ``W_UK`` absorbed into its nope part; returns [B, H, r], the attention-weighted
    latents, which ``W_UV`` turns into values. Every head reads the same latent rows. An fp8
    cache is dequantised with ``k_scale`` first, then everything runs in float32."""
    if q.shape[0] == 0:
        return q.new_empty(0, q.shape[1], kv_lora_rank)
    # all rows at once, padded to the longest sequence
    block_size, max_len = kv_cache.shape[1], int(seq_lens.max())
    blocks = block_tables[:, : -(-max_len // block_size)].long()
    lat = from_cache(kv_cache[blocks].flatten(1, 2)[:, :max_len], torch.float32, k_scale)  # [B, S, r + rope]
    scores = torch.bmm(q.float(), lat.transpose(1, 2)) * scale  # [B, H, S]
    valid = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]
    probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1)
    return torch.bmm(probs, lat[..., :kv_lora_rank]).to(q.dtype)


def mla_prefill_attention(
    q: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, scale: float, v_head_dim: int,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of each of the step's sequences over its keys: sequence ``i``'s query
    rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` are the last of its key rows
    ``cu_seqlens_k[i]:cu_seqlens_k[i+1]`` (the same rows for a whole prompt; a chunk after
    earlier rows has more keys than queries). ``q`` [Tq, H, nope + rope] (rotated); ``kv``
    [Tk, H, nope + v], ``kv_b_proj`` of the latents (the keys' nope part, then the values);
    ``k_pe`` [Tk, rope], the rotated RoPE keys, shared by the heads. ``max_seqlen_q`` sizes the
    kernel's grid. Returns [Tq, H, v]."""
    nope = kv.shape[-1] - v_head_dim
    k = torch.cat((kv[..., :nope], k_pe.unsqueeze(1).expand(-1, kv.shape[1], -1)), dim=-1)
    v = kv[..., nope:]
    out = q.new_empty(q.shape[0], q.shape[1], v_head_dim)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        if q1 == q0:
            continue
        qs, ks, vs = q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1)
        if q1 - q0 == k1 - k0:  # SDPA's is_causal: no mask built
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        else:  # query j sits at key position (k1 - k0) - (q1 - q0) + j
            q_pos = torch.arange(k1 - k0 - (q1 - q0), k1 - k0, device=q.device)
            mask = torch.arange(k1 - k0, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[q0:q1] = o.transpose(0, 1)
    return out


def mla_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor | None,
    new_latents: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    kv_b_weight: torch.Tensor,
    scale: float,
    v_head_dim: int,
    k_scale: torch.Tensor | None = None,
    attend=mla_prefill_attention,
    host_lens: tuple[list[int], list[int]] | None = None,
) -> torch.Tensor:
    """Prompt attention, the latents expanded to per-head keys and values through
    ``kv_b_proj`` (cheaper than absorption when many queries share the keys). Sequence
    ``i`` owns query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``, the last of its
    ``seq_lens[i]`` tokens; earlier tokens (a cached prefix, previous chunks) come from the
    paged cache. ``q``: [T, H, nope + rope] (rotated); ``new_latents``: [T, r + rope], this
    step's rows (a whole prompt, or the memory-profiling run without a cache, reads only
    these); ``kv_b_weight``: [H * (nope + v), r]. Whole prompts go to ``attend``
    (``mla_prefill_attention``'s signature: its reference, or ``ops.mla_prefill_attention``)
    together, after one ``kv_b_proj`` GEMM over the step's rows; a sequence with earlier rows
    goes on its own, over all its keys read back from the cache. ``host_lens``:
    ``cu_seqlens_q`` and ``seq_lens`` as host lists (else read from the device: a sync that
    stalls the GPU in every layer). Returns [T, H, v].

    An fp8 cache (``k_scale``) is always read back, this step's rows included: every row then
    sees the quantised latents that decode reads, so chunking, prefix caching and
    speculative verification give the tokens plain decoding gives (as atom's fp8 cache does for
    ordinary attention; vLLM's MLA prefill uses the new rows unquantised)."""
    num_heads, rope_dim = q.shape[1], new_latents.shape[-1] - kv_b_weight.shape[1]
    rank, nope = kv_b_weight.shape[1], q.shape[-1] - rope_dim
    cu, lens = host_lens if host_lens is not None else (cu_seqlens_q.tolist(), seq_lens.tolist())
    fp8 = kv_cache is not None and kv_cache.dtype == torch.float8_e4m3fn
    q_lens = [end - start for start, end in zip(cu, cu[1:])]
    whole = [kv_cache is None or seq_len == n for seq_len, n in zip(lens, q_lens)]
    if any(whole):  # every sequence's rows; those of the others are replaced below
        lat = new_latents
        if fp8:  # a whole prompt's rows as the cache holds them
            lat = new_latents.clone()
            for i in (i for i, w in enumerate(whole) if w and q_lens[i]):
                lat[cu[i] : cu[i + 1]] = from_cache(_latents(kv_cache, block_tables[i], lens[i]), q.dtype, k_scale)
        kv = F.linear(lat[:, :rank], kv_b_weight).view(q.shape[0], num_heads, nope + v_head_dim)
        out = attend(q, kv, lat[:, rank:], cu_seqlens_q, cu_seqlens_q, max(q_lens), scale, v_head_dim)
    else:
        out = q.new_empty(q.shape[0], num_heads, v_head_dim)
    for i, seq_len in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        if whole[i] or end == start:
            continue
        # a cached prefix or earlier chunks: the sequence read back, its keys expanded one
        # sequence at a time (a long prefix expands to H x (nope + v) values a token)
        lat = from_cache(_latents(kv_cache, block_tables[i], seq_len), q.dtype, k_scale)
        kv = F.linear(lat[:, :rank], kv_b_weight).view(seq_len, num_heads, nope + v_head_dim)
        # [0, rows] and [0, keys] cut from the device tensors: no host-to-device copy, no sync
        cu_q = (cu_seqlens_q[i : i + 2] - cu_seqlens_q[i]).to(torch.int32)
        cu_k = F.pad(seq_lens[i : i + 1], (1, 0)).to(torch.int32)
        out[start:end] = attend(q[start:end], kv, lat[:, rank:], cu_q, cu_k, end - start, scale, v_head_dim)
    return out
