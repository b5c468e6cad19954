"""Linear layers that shard over tensor parallelism and load their own weights.

Each parameter carries ``weight_loader(param, loaded, shard_id=None)``: the checkpoint
loader hands it the full tensor (or a ``CheckpointSlice`` of it, read only where narrowed)
and the layer copies its shard into place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom import ops
from atom.distributed.parallel_state import SINGLE, TPInfo
from atom.model_loader.checkpoint_slice import materialize


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(materialize(loaded))


def apply_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``: through ``ops.linear`` on CUDA (the skinny Triton GEMM for decode-sized
    batches); plain F.linear elsewhere, so CPU graphs keep inductor's own matmul."""
    return ops.linear(x, weight, bias) if x.is_cuda else F.linear(x, weight, bias)


def _param(*shape: int, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = loader
    return p


class LinearBase(nn.Module):
    quant_method = None  # set by atom.layers.quantization for quantised weights
    # stays in the model dtype under any quantisation: FP8 checkpoints keep it so (the MTP
    # layer's eh_proj in DeepSeek-V3/R1, vLLM's nn.Linear)
    unquantized = False
    # the owner reads .weight itself (MLA's kv_b_proj): an FP8 checkpoint's weight is
    # dequantised to the model dtype after loading, as vLLM does; with --quantization fp8 it is
    # left unquantised
    dequantize_after_loading = False
    # the activation group its FP8 method reads codes in (``forward``'s ``x_q``): set by a block-scaled
    # method, so the RMS norm before the layer writes them (``RMSNorm.forward``'s ``quant_group``); 0: none
    input_group = 0

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPInfo, shard_dim: int | None):
        super().__init__()
        self.tp = tp
        self.shard_dim = shard_dim
        self.input_size, self.output_size = input_size, output_size
        self.weight = _param(output_size, input_size, loader=self.weight_loader)
        self.bias = _param(output_size, loader=self.weight_loader) if bias else None

    def _shard(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        dim = self.shard_dim if param.dim() > 1 or self.shard_dim == 0 else None
        if dim is None or self.tp.size == 1:
            return loaded
        size = param.shape[dim]
        return loaded.narrow(dim, self.tp.rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, self._shard(param, loaded))

    def forward(self, x: torch.Tensor, x_q: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x_q``: ``x``'s e4m3 codes and scales in groups of ``input_group`` (only where that is set)."""
        if x_q is not None:
            return self.quant_method.apply(self, x, self.bias, x_q)
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return apply_linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, SINGLE, None)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPInfo = SINGLE):
        if output_size % tp.size:
            raise ValueError(f"output size {output_size} not divisible by tensor-parallel size {tp.size}")
        super().__init__(input_size, output_size // tp.size, bias, tp, 0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matrix (gate/up -> gate_up_proj). Parts marked
    ``replicated`` are whole on every rank (DeepSeek's ``fused_qkv_a_proj``: the query
    projection split by heads, the replicated latent projection beside it)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, tp: TPInfo = SINGLE,
                 replicated: tuple[bool, ...] = ()):  # fmt: skip
        self.output_sizes = output_sizes
        self.replicated = replicated or (False,) * len(output_sizes)
        if any(s % tp.size for s, whole in zip(output_sizes, self.replicated) if not whole):
            raise ValueError(f"output sizes {output_sizes} not divisible by tensor-parallel size {tp.size}")
        self.rank_sizes = [s if whole else s // tp.size for s, whole in zip(output_sizes, self.replicated)]
        LinearBase.__init__(self, input_size, sum(self.rank_sizes), bias, tp, 0)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset, size = sum(self.rank_sizes[:shard_id]), self.rank_sizes[shard_id]
        target = param.data.narrow(0, offset, size)
        if self.tp.size > 1 and not self.replicated[shard_id]:
            loaded = loaded.narrow(0, self.tp.rank * size, size)
        default_weight_loader(target, loaded)

    def silu_and_mul(self, x: torch.Tensor, x_q: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``silu_and_mul(self(x))`` of a gate / up pair: unquantised on CUDA one op (``ops.gated_linear``:
        at decode sizes the activation in the GEMM's epilogue, a launch fewer), quantised its method's
        ``apply_gated`` where it has one (given ``x_q`` as ``forward`` is)."""
        if x_q is not None:
            return self.quant_method.apply_gated(self, x, self.bias, x_q)
        if self.quant_method is None and x.is_cuda:
            return ops.gated_linear(x, self.weight, self.bias)
        if self.quant_method is not None and hasattr(self.quant_method, "apply_gated"):
            return self.quant_method.apply_gated(self, x, self.bias)
        return ops.silu_and_mul(self(x))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix; KV heads are replicated when there are fewer
    of them than ranks."""

    def __init__(
        self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
        bias: bool = False, tp: TPInfo = SINGLE,
    ):
        if num_heads % tp.size or (num_kv_heads % tp.size and tp.size % num_kv_heads):
            raise ValueError(f"{num_heads} attention heads and {num_kv_heads} KV heads cannot be split over "
                             f"tensor-parallel size {tp.size}")
        self.head_size = head_size
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp.size
        super().__init__(hidden_size, out, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        rank = self.tp.rank if shard_id == "q" else self.tp.rank // self.kv_replicas
        target = param.data.narrow(0, offset, size)
        default_weight_loader(target, loaded.narrow(0, rank * size, size) if self.tp.size > 1 else loaded)


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPInfo = SINGLE):
        if input_size % tp.size:
            raise ValueError(f"input size {input_size} not divisible by tensor-parallel size {tp.size}")
        super().__init__(input_size // tp.size, output_size, bias, tp, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # bias added once, after the reduction
        bias = self.bias if self.tp.rank == 0 else None
        y = apply_linear(x, self.weight, bias) if self.quant_method is None else self.quant_method.apply(self, x, bias)
        return self.tp.all_reduce(y)
