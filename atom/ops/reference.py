"""Plain PyTorch definitions of every op atom's models use.

They run on any device and are the definition of correct: each Triton kernel in
``atom.ops.triton`` is tested against the function of the same name here.

KV-cache layout (per layer): ``k_cache`` and ``v_cache`` are
``[num_blocks, num_kv_heads, block_size, head_dim]`` ("HND"). A token's slot is
``block_id * block_size + offset``. One (block, kv-head) tile is contiguous, which is
what the paged-attention kernels load.

FP8 KV cache: a cache of dtype ``float8_e4m3fn`` holds ``clamp(x / scale)`` rounded to e4m3,
with one float32 scale per layer for K and one for V (``k_scale``/``v_scale``, 1-element
tensors); attention reads ``cache * scale``. Other cache dtypes ignore the scales.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with ``residual``, first ``x = x + residual`` and
    return ``(normed, x)`` (the new residual), as Hugging Face does in the model dtype."""
    if residual is not None:
        x = x + residual
        residual = x
    orig_dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(orig_dtype)
    return out if residual is None else (out, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dim ``2 * d``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE. ``q``: [T, Hq, D], ``k``: [T, Hk, D], ``cos_sin_cache``:
    [max_pos, D] float32 holding ``cat(cos, sin)`` of the half dim. Returns new tensors."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(q.dtype)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(q.dtype)
    return _rotate_neox(q, cos, sin), _rotate_neox(k, cos, sin)


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` as the cache stores it: divided by ``scale`` (float32) and saturated for fp8."""
    if cache_dtype != torch.float8_e4m3fn:
        return x.to(cache_dtype)
    x = x.float() if scale is None else x.float() / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def from_cache(cache: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache values back in ``dtype`` (fp8 times its scale, in float32 first)."""
    if cache.dtype != torch.float8_e4m3fn:
        return cache.to(dtype)
    return (cache.float() if scale is None else cache.float() * scale).to(dtype)


def store_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Write new keys/values ``[T, Hk, D]`` into the paged cache at ``slot_mapping`` ([T];
    a negative slot means "do not store", used for padded rows)."""
    block_size = k_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, :, offsets] = to_cache_dtype(k[keep], k_cache.dtype, k_scale)
    v_cache[blocks, :, offsets] = to_cache_dtype(v[keep], v_cache.dtype, v_scale)


def qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (Qwen3; skipped when the weights are None), RoPE, and
    the KV-cache write, as one op so a GPU kernel can fuse all four. Returns (q, k)."""
    if q_norm_weight is not None:
        q = rms_norm(q, q_norm_weight, eps)
        k = rms_norm(k, k_norm_weight, eps)
    q, k = rotary_embedding(positions, q, k, cos_sin_cache)
    if k_cache is not None and k_cache.numel() > 0:
        store_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q, k


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    num_decode_tokens: int = 0,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a mixed batch over the paged cache (new K/V already stored).

    Sequence ``i`` owns query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``: the last
    ``q_len`` of its ``seq_lens[i]`` tokens. A decode row is simply ``q_len == 1``.
    ``q``: [T, Hq, D]; returns [T, Hq, D]. GQA when Hq is a multiple of Hk.
    ``num_decode_tokens``: the first that many sequences are decode rows (a hint that lets
    a kernel launch them separately; the reference ignores it).
    ``k``/``v``: optionally the batch's new keys and values [T, Hk, D], the values the cache
    already holds for them (a kernel may read them packed instead of through the block
    table; the reference ignores them). ``k_scale``/``v_scale``: an fp8 cache's scales.
    """
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        n_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[i, :n_blocks].long()
        # [n_blocks, Hk, bs, D] -> [Hk, n_blocks * bs, D] -> first seq_len tokens
        k = k_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, k_cache.shape[3])[:, :seq_len]
        v = v_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, v_cache.shape[3])[:, :seq_len]
        k = from_cache(k, q.dtype, k_scale).repeat_interleave(group, dim=0)
        v = from_cache(v, q.dtype, v_scale).repeat_interleave(group, dim=0)
        qi = q[start:end].transpose(0, 1)  # [Hq, q_len, D]
        # query row j sits at absolute position seq_len - q_len + j
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


def moe_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing in float32, then top-k; returns (weights float32 [T, k], ids int64 [T, k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str,
    num_groups: int,
    topk_groups: int,
    correction_bias: torch.Tensor | None,
    renormalize: bool,
    scaling: float,
    num_fused_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's expert routing, top-k within the best expert groups; returns (weights
    float32 [T, k + S], ids int64 [T, k + S]), ``S = num_fused_shared``: every token's shared
    experts as experts ``E .. E + S - 1`` of weight 1 after its routed ones (``FusedMoE``'s
    ``num_shared``). DeepSeek-V2 scores experts with a softmax and picks
    groups by their best expert (``group_limited_greedy``; plain ``greedy`` has one group);
    DeepSeek-V3 scores with a sigmoid, adds the ``noaux_tc`` load-balancing bias to the scores
    used for the choice only, and picks groups by the sum of their two best experts. The
    weights are the chosen experts' unbiased scores, optionally renormalised, times
    ``scaling`` (``routed_scaling_factor``). In float32, as Hugging Face routes."""
    logits = router_logits.float()
    if scoring == "sigmoid":
        scores = logits.sigmoid()
    elif scoring == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"unknown expert scoring function {scoring!r} (expected 'sigmoid' or 'softmax')")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1 and topk_groups < num_groups:
        grouped = choice.view(choice.shape[0], num_groups, -1)
        if correction_bias is None:
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = group_scores.topk(topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape_as(choice)
        # V2 zeroes the other groups' softmax scores, V3 rules them out
        choice = choice.masked_fill(~keep, 0.0 if correction_bias is None else float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = (scores if correction_bias is not None else choice).gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * scaling
    if num_fused_shared:
        shared = torch.arange(scores.shape[1], scores.shape[1] + num_fused_shared, device=ids.device)
        ids = torch.cat((ids, shared.expand(ids.shape[0], -1)), dim=1)
        weights = torch.cat((weights, weights.new_ones(weights.shape[0], num_fused_shared)), dim=1)
    return weights, ids


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Mixture of SiLU-gated experts. ``x``: [T, H]; ``w13``: [E, 2I, H] (gate rows then up
    rows); ``w2``: [E, H, I]. Each token's output is the routing-weighted sum of its
    top-k experts (weights cast to ``x.dtype`` first, as Hugging Face does)."""
    out = torch.zeros_like(x)
    weights = topk_weights.to(x.dtype)
    for e in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == e)
        h = silu_and_mul(x[token_idx] @ w13[e].t()) @ w2[e].t()
        out.index_add_(0, token_idx, h * weights[token_idx, slot, None])
    return out


def top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """Mask (set to -inf) the tokens each row may not sample. Per-row parameters:
    ``top_k`` int [B] (0 = off), ``top_p`` float [B] (1 = off), ``min_p`` float [B] (0 = off).
    ``logits`` are already temperature-scaled; returns a new tensor. Tokens of equal value
    share one fate: top-k keeps every token at least the k-th largest value (as vLLM's top-k),
    top-p judges a token by the mass of the tokens strictly greater than it, so a threshold
    on the value reproduces the kept set exactly."""
    logits = logits.clone()
    if top_k is not None or top_p is not None:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        vocab = logits.shape[-1]
        if top_k is not None:
            k = torch.where(top_k <= 0, vocab, top_k).clamp(max=vocab)
            kth = sorted_logits.gather(1, (k - 1)[:, None].long())
            remove |= sorted_logits < kth
        if top_p is not None:
            # top-p over what top-k kept, renormalised (vLLM's order)
            probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
            # keep a token if the mass strictly before it is below top_p (the first always stays);
            # top_p = 1 is off: the float cumsum can round up to 1 before the tail ends
            mass_before = probs.cumsum(dim=-1) - probs
            # ties: each token takes the mass before the first of its equal values
            ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
            starts = torch.ones_like(remove)
            starts[:, 1:] = sorted_logits[:, 1:] != sorted_logits[:, :-1]
            first = torch.where(starts, ranks, 0).cummax(dim=-1).values
            mass_before = mass_before.gather(1, first)
            remove |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
        remove[:, 0] = False
        logits.scatter_(-1, sorted_idx, sorted_logits.masked_fill(remove, float("-inf")))
    if min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits.masked_fill_(probs < threshold, float("-inf"))
    return logits
