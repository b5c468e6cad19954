"""Reference of the fused sampling op: temperature, top-k / top-p / min-p, and the draw.

A row with temperature 0 takes the argmax of its logits. Any other row divides by its
temperature, keeps what ``reference.top_k_top_p_min_p`` keeps and draws with the Gumbel
race: the argmax over kept tokens of ``u - log(E)``, E ~ Exp(1), which is the argmax of
``p / E`` (the exponential race) and samples from ``p`` without a normaliser or a
cumulative sum. E comes from Philox keyed by the row's ``seed`` (four tokens per counter),
exactly as ``tl.randint4x`` in the kernel, so the kernel and this reference draw the same
noise: a row's token depends only on its logits, parameters and seed.
"""

from __future__ import annotations

import torch

from atom.ops import reference

_M32 = 0xFFFFFFFF
# Philox4x32-10 constants (Triton's ``tl.randint``)
_KEY_A, _KEY_B, _ROUND_A, _ROUND_B = 0x9E3779B9, 0xBB67AE85, 0xD2511F53, 0xCD9E8D57


def _mul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``a * b`` (uint32 values in int64 tensors), without overflow:
    ``a`` is split into 16-bit halves so each partial product stays below 2^48."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    hi_part, lo_part = a_hi * b, a_lo * b
    mid = hi_part + (lo_part >> 16)
    return mid >> 16, (((hi_part & 0xFFFF) << 16) + lo_part) & _M32


def philox_bits(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] uint32 values (int64): token t takes word t % 4 of Philox4x32-10 keyed by
    the row's seed at counters (t // 4, 0, 0, 0), as ``tl.randint4x(seed, t // 4)``."""
    seeds = seeds.to(torch.int64)[:, None]
    k0, k1 = seeds & _M32, (seeds >> 32) & _M32
    c0 = torch.arange(-(-vocab // 4), dtype=torch.int64, device=seeds.device)[None, :].expand(seeds.shape[0], -1)
    c1 = c2 = c3 = torch.zeros_like(c0)
    for _ in range(10):
        hi_b, lo_b = _mul32(_ROUND_B, c2)
        hi_a, lo_a = _mul32(_ROUND_A, c0)
        c0, c2, c1, c3 = hi_b ^ c1 ^ k0, hi_a ^ c3 ^ k1, lo_b, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return torch.stack([c0, c1, c2, c3], dim=-1).flatten(1)[:, :vocab]


def gumbel_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """-log(E), E = -log(U) ~ Exp(1), from the top 23 random bits: U = (bits + 1/2) / 2^23 is
    exact in float32 and strictly inside (0, 1), so E is finite and never 0."""
    u = ((bits >> 9).to(torch.float32) + 0.5) * 2.0**-23
    return -torch.log(-torch.log(u))


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,
) -> torch.Tensor:
    """[B] int64 sampled token per row. ``temperatures`` float32 [B] (0 = greedy),
    ``top_k`` / ``top_p`` / ``min_p`` as in ``reference.top_k_top_p_min_p``, ``seeds`` int64
    [B] (this step's Philox key per row)."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    temps = torch.where(temperatures > 0, temperatures, 1.0)
    scaled = logits / temps[:, None]
    if top_k is not None or top_p is not None or min_p is not None:
        scaled = reference.top_k_top_p_min_p(scaled, top_k, top_p, min_p)
    score = scaled + gumbel_from_bits(philox_bits(seeds, logits.shape[-1]))
    return torch.where(temperatures > 0, score.argmax(dim=-1), greedy)
