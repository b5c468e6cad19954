from __future__ import annotations

import torch
from torch import nn

from atom import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, quant_group: int = 0):
        """Without ``residual``: the normed ``x``. With it: ``(norm(x + residual), x + residual)``; with
        ``quant_group`` too, a third item: the normed rows' e4m3 codes and scales in groups of that many
        columns (``ops.fused_add_rms_norm_fp8``), for the FP8 linear after the norm."""
        if quant_group:
            out, summed, codes, scales = ops.fused_add_rms_norm_fp8(x, self.weight, self.eps, residual, quant_group)
            return out, summed, (codes, scales)
        return ops.rms_norm(x, self.weight, self.eps, residual)
