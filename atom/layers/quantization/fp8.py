"""FP8 linear layers and fused MoE: e4m3 weights with float32 scales stored one row per
output row (``atom.ops.reference_fp8`` explains why), activations quantised per token (or
per 128-column group with block weights) on the fly.

A method object is attached to each layer (``layer.quant_method``) after the model is built;
it swaps the weight parameters for e4m3 ones with scale parameters beside them (or, for
``--quantization fp8``, quantises the loaded high-precision weights once loading is done).
Linear GEMMs run ``ops.w8a8_matmul`` (Triton on a GPU, the reference on the CPU); on a GPU,
per-channel weights use ``torch._scaled_mm`` unless ``ATOM_FP8_SCALED_MM=0``, and 128x128-block
weights its block-wise mode above the decode sizes unless ``ATOM_FP8_SCALED_MM_BLOCK=0``
(cuBLASLt: 1.4-2.0x the Triton tile kernel from 256 rows, tests/gpu/fp8_gemm_probe.py).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from atom import ops
from atom.layers.linear import ColumnParallelLinear, LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from atom.layers.moe import FusedMoE
from atom.layers.quantization.fp8_config import Fp8Config
from atom.model_loader.checkpoint_slice import materialize
from atom.ops import reference_fp8

FP8 = torch.float8_e4m3fn
# an activation's e4m3 codes [M, K] and group scales [M, K / group] (per_token_group_quant_fp8's)
Codes = tuple[torch.Tensor, torch.Tensor]
# block-scaled layers ask the RMS norm before them for their input's codes (``layer.input_group``), so the
# GEMM reads them instead of quantising its input itself: the same bits, one quantisation fewer. Off: on one
# H100 (session 39) Qwen3-8B-FP8's latency run with it on did not finish the start-up warm-up in 125 s or,
# caches warm, 150 s, where with it off the whole run took 105 s (docs/performance.md); not yet diagnosed
NORM_WRITES_CODES = False


def _param(data: torch.Tensor, loader) -> nn.Parameter:
    p = nn.Parameter(data, requires_grad=False)
    p.weight_loader = loader
    return p


def _k_major(scale: torch.Tensor) -> torch.Tensor:
    """The same scales [..., N, groups] stored group-major (each group's N scales contiguous):
    the FP8 GEMMs read one group's scale vector per key step, one contiguous read then."""
    return scale.transpose(-1, -2).contiguous().transpose(-1, -2)


def _expand_rows(scale: torch.Tensor, rows: int, cols: int, block_rows: int | None) -> torch.Tensor:
    """A checkpoint's scale (per tensor, per channel or per block) as one row of ``cols``
    scales per weight row."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, cols)
    if block_rows is None:
        return scale.reshape(rows, 1).expand(rows, cols)
    return scale.repeat_interleave(block_rows, dim=0)[:rows]


def _checkpoint_rows(layer: LinearBase, shard_id) -> int:
    """Rows of the checkpoint tensor a linear layer's shard comes from (before the split)."""
    tp = layer.tp.size
    if isinstance(layer, QKVParallelLinear):
        if shard_id == "q":
            return layer.num_heads * layer.head_size * tp
        return layer.num_kv_heads * tp // layer.kv_replicas * layer.head_size
    if isinstance(layer, MergedColumnParallelLinear):
        return layer.output_sizes[shard_id]
    if isinstance(layer, ColumnParallelLinear):
        return layer.output_size * tp
    return layer.output_size


class Fp8LinearMethod:
    def __init__(self, config: Fp8Config):
        self.config = config
        self.group_k = config.group_k
        self.scaled_mm = config.block is None and os.environ.get("ATOM_FP8_SCALED_MM", "1") == "1"
        self.scaled_mm_block = os.environ.get("ATOM_FP8_SCALED_MM_BLOCK", "1") == "1"
        self.block_scale = None  # the weight's scales per 128x128 block, for torch._scaled_mm

    def create_weights(self, layer: LinearBase) -> None:
        layer.quant_method = self
        if not self.config.serialized:
            return  # loaded in the model dtype, quantised in process_weights_after_loading
        n, k = layer.weight.shape
        device = layer.weight.device
        self.dtype = layer.weight.dtype  # the model dtype, for dequantize_after_loading
        layer.weight = _param(torch.empty(n, k, dtype=FP8, device=device), layer.weight_loader)
        cols = -(-k // self.group_k) if self.group_k else 1
        scale = _param(torch.empty(n, cols, dtype=torch.float32, device=device), None)
        scale.weight_loader = lambda param, loaded, shard_id=None: self._load_scale(layer, param, loaded, shard_id)
        layer.register_parameter(self.config.scale_name, scale)

    def _load_scale(self, layer: LinearBase, param: nn.Parameter, loaded, shard_id) -> None:
        block_rows = self.config.block[0] if self.config.block else None
        full_cols = -(-layer.input_size * (layer.tp.size if layer.shard_dim == 1 else 1) // self.group_k) \
            if self.group_k else 1
        scale = _expand_rows(materialize(loaded), _checkpoint_rows(layer, shard_id), full_cols, block_rows)
        if layer.shard_dim == 0:  # column parallel: split and placed by the layer's own loader
            args = () if shard_id is None else (shard_id,)
            return layer.weight_loader(param, scale.contiguous(), *args)
        cols = param.shape[1]
        if layer.tp.size > 1 and self.group_k:
            if layer.input_size % self.group_k:
                raise ValueError(f"input size {layer.input_size} per rank is not a whole number of "
                                 f"{self.group_k}-column scale blocks")
            scale = scale.narrow(1, layer.tp.rank * cols, cols)
        if tuple(scale.shape) != tuple(param.shape):
            raise ValueError(f"scale shape {tuple(scale.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(scale)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if layer.dequantize_after_loading:  # serialized: quantize_layers skips it otherwise
            w = reference_fp8.dequantize(layer.weight.data, getattr(layer, self.config.scale_name).data, self.group_k)
            layer.weight = _param(w.to(self.dtype), layer.weight_loader)
            delattr(layer, self.config.scale_name)
            layer.quant_method = None
            return
        if not self.config.serialized:
            q, s = reference_fp8.quantize_weight(layer.weight.data)
            layer.weight = _param(q, layer.weight_loader)
            layer.register_parameter(self.config.scale_name, _param(s, None))
        elif self.group_k:
            scale = getattr(layer, self.config.scale_name).data
            setattr(layer, self.config.scale_name, _param(_k_major(scale), None))
            if self.scaled_mm_block and layer.weight.is_cuda:
                from atom.ops.triton.fp8_gemm import scaled_mm_block_scales

                self.block_scale = scaled_mm_block_scales(layer.weight.data, scale, self.group_k)
            if NORM_WRITES_CODES and layer.input_size % self.group_k == 0:
                layer.input_group = self.group_k
        self.scale = getattr(layer, self.config.scale_name)

    def apply(
        self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None, x_q: Codes | None = None
    ) -> torch.Tensor:
        """``x_q``: ``x``'s codes and scales, 1 x ``layer.input_group`` per row, where the norm before made
        them (block scales only)."""
        x2 = x.reshape(-1, x.shape[-1])
        scale = getattr(layer, self.config.scale_name)
        # rowwise-scaled _scaled_mm: bf16 output, dims multiples of 16
        if x.is_cuda and self.scaled_mm and x.dtype == torch.bfloat16 and not (layer.weight.shape[0] % 16
                                                                              or layer.weight.shape[1] % 16):
            a, a_scale = ops.per_token_group_quant_fp8(x2, self.group_k)
            out = torch._scaled_mm(a, layer.weight.t(), scale_a=a_scale, scale_b=scale.t(), out_dtype=x.dtype)
            out = out if bias is None else out + bias
        else:
            block_scale = self.block_scale if x.dtype == torch.bfloat16 else None
            out = ops.fp8_linear(x2, layer.weight, scale, self.group_k, bias, block_scale, *(x_q or (None, None)))
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def apply_gated(
        self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None, x_q: Codes | None = None
    ) -> torch.Tensor:
        """``silu_and_mul(apply(...))`` of a gate / up pair: with block scales one op
        (``ops.fp8_gated_linear``: at decode sizes the activation in the skinny kernel's launch)."""
        if not self.group_k:
            return ops.silu_and_mul(self.apply(layer, x, bias))
        x2 = x.reshape(-1, x.shape[-1])
        block_scale = self.block_scale if x.dtype == torch.bfloat16 else None
        out = ops.fp8_gated_linear(x2, layer.weight, getattr(layer, self.config.scale_name), self.group_k, bias,
                                   block_scale, *(x_q or (None, None)))  # fmt: skip
        return out.reshape(*x.shape[:-1], out.shape[-1])


class Fp8MoEMethod:
    """Experts' e4m3 weights [E, N, K] with row-expanded scales [E, N, groups]; the GEMMs run
    through ``ops.fused_moe_fp8`` (Triton on a GPU, the reference on the CPU)."""

    def __init__(self, config: Fp8Config):
        self.config = config
        self.group_k = config.group_k

    def _names(self) -> tuple[str, str]:
        return f"w13_{self.config.scale_name}", f"w2_{self.config.scale_name}"

    def create_weights(self, moe: FusedMoE) -> None:
        moe.quant_method = self
        if not self.config.serialized:
            return
        for name, scale_name in zip(("w13_weight", "w2_weight"), self._names()):
            old = getattr(moe, name)
            e, n, k = old.shape
            setattr(moe, name, _param(torch.empty(e, n, k, dtype=FP8, device=old.device), moe.weight_loader))
            cols = -(-k // self.group_k) if self.group_k else 1
            scale = _param(torch.empty(e, n, cols, dtype=torch.float32, device=old.device), None)
            scale.weight_loader = lambda p, loaded, shard_id, expert_id: self._load_scale(moe, p, loaded, shard_id,
                                                                                          expert_id)
            moe.register_parameter(scale_name, scale)

    def _load_scale(self, moe: FusedMoE, param: nn.Parameter, loaded, shard_id: str, expert_id: int) -> None:
        """One expert's scales, or the shared MLP's (expert ``E``: ``num_shared`` experts' side by
        side, as ``FusedMoE.weight_loader`` splits its weights) into their slots."""
        shared = expert_id == moe.num_experts and moe.num_shared
        if not shared and expert_id not in moe.local_experts:
            return
        copies = moe.num_shared if shared else 1
        slices = moe.tp.size if not moe.tp.expert_parallel else 1
        full = moe.intermediate * slices  # one expert's intermediate width in the checkpoint
        block_rows = self.config.block[0] if self.config.block else None
        if shard_id == "w2":  # the experts side by side along the input columns
            groups = -(-full * copies // self.group_k) if self.group_k else 1
            scale = _expand_rows(materialize(loaded), param.shape[1], groups, block_rows)
            step = full // self.group_k if self.group_k and copies > 1 else 0
            parts = [scale.narrow(1, s * step, step) if step else scale for s in range(copies)]
        else:
            scale = _expand_rows(materialize(loaded), full * copies, param.shape[2], block_rows)
            parts = [scale.narrow(0, s * full, full) for s in range(copies)]
        first = len(moe.local_experts) if shared else expert_id - moe.local_experts.start
        for s, part in enumerate(parts):
            self._load_slot_scale(moe, param, part, shard_id, first + s)

    def _load_slot_scale(self, moe: FusedMoE, param: nn.Parameter, scale: torch.Tensor, shard_id: str,
                         index: int) -> None:  # fmt: skip
        """One whole expert's row-expanded gate, up or down scales into local slot ``index``
        (this rank's slice of them)."""
        size, cols = moe.intermediate, param.shape[2]
        if shard_id == "w2":
            if scale.shape[1] > cols and self.group_k:  # tensor parallel: this rank's input columns
                if size % self.group_k:
                    raise ValueError(f"moe intermediate size {size} per rank is not a whole number of "
                                     f"{self.group_k}-column scale blocks")
                scale = scale.narrow(1, moe.slice_rank * cols, cols)
            target = param.data[index]
        else:
            scale = scale.narrow(0, moe.slice_rank * size, size)
            target = param.data[index].narrow(0, 0 if shard_id == "w1" else size, size)
        if target.shape != scale.shape:
            raise ValueError(f"expert slot {index} {shard_id} scale: shape {tuple(scale.shape)}, "
                             f"expected {tuple(target.shape)}")
        target.copy_(scale)

    def process_weights_after_loading(self, moe: FusedMoE) -> None:
        if self.config.serialized:
            if self.group_k:
                for scale_name in self._names():
                    setattr(moe, scale_name, _param(_k_major(getattr(moe, scale_name).data), None))
            return
        for name, scale_name in zip(("w13_weight", "w2_weight"), self._names()):
            w = getattr(moe, name).data
            pairs = [reference_fp8.quantize_weight(w[e]) for e in range(w.shape[0])]
            setattr(moe, name, _param(torch.stack([q for q, _ in pairs]), moe.weight_loader))
            moe.register_parameter(scale_name, _param(torch.stack([s for _, s in pairs]), None))

    def apply(self, moe: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        s13, s2 = (getattr(moe, n) for n in self._names())
        return ops.fused_moe_fp8(x, moe.w13_weight, s13, moe.w2_weight, s2, weights, ids, self.group_k)
