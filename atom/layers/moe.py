"""Mixture of experts: all experts' weights in two stacked parameters, routed by ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom import ops
from atom.distributed.parallel_state import SINGLE, TPInfo
from atom.model_loader.checkpoint_slice import materialize


class FusedMoE(nn.Module):
    """``w13_weight`` [E, 2I, H] (gate rows, then up rows) and ``w2_weight`` [E, H, I].
    Tensor parallelism shards the intermediate dim of every expert; expert parallelism
    (``tp.expert_parallel``) instead keeps whole experts, E / size of them per rank.

    ``num_shared``: shared experts (DeepSeek's) held as experts ``E .. E + S - 1`` after the
    routed ones, each an ``I``-wide slice of the shared MLP (an MLP is the sum of its
    intermediate channels' contributions). Small batches route every token to them with weight
    1 (``ops.grouped_topk(..., num_fused_shared=S)``): one fused MoE launch instead of the
    MLP's kernels; large ones run them as a dense MLP on the same weights
    (``forward_routed(..., dense_shared=True)``): cuBLAS's GEMMs ran a DeepSeek-V2-Lite
    prompt's shared MLP at ~2.7x the MoE kernel's rate (session 22's profile)."""

    quant_method = None  # set by atom.layers.quantization for FP8 experts

    def __init__(
        self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
        renormalize: bool, tp: TPInfo = SINGLE, num_shared: int = 0,
    ):
        super().__init__()
        tp = tp.moe or tp  # data-parallel attention: experts over all replicas
        if num_shared and tp.expert_parallel:
            raise ValueError("shared experts are fused into the MoE only without expert parallelism")
        self.local_experts = tp.local_experts(num_experts)
        slices = 1 if tp.expert_parallel else tp.size
        if intermediate_size % slices:
            raise ValueError(f"moe intermediate size {intermediate_size} not divisible by tp size {tp.size}")
        self.num_experts, self.top_k, self.renormalize, self.tp = num_experts, top_k, renormalize, tp
        self.intermediate = intermediate_size // slices
        self.slice_rank = 0 if tp.expert_parallel else tp.rank
        self.num_shared = num_shared
        local = len(self.local_experts) + num_shared
        self.w13_weight = nn.Parameter(torch.empty(local, 2 * self.intermediate, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(local, hidden_size, self.intermediate), requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader

    @staticmethod
    def expert_mapping(
        num_experts: int, prefix: str = "experts", num_shared: int = 0
    ) -> list[tuple[str, str, int, str]]:
        """(parameter name, checkpoint name fragment, expert, shard) for the loader; with
        ``num_shared``, the shared MLP's tensors (``shared_experts.*``) as expert ``E``."""
        modules = [(f"{prefix}.{e}", e) for e in range(num_experts)]
        if num_shared:
            modules.append((f"shared_{prefix}", num_experts))
        mapping = []
        for module, e in modules:
            for ckpt, shard in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                param = f"{prefix}.w2_weight" if shard == "w2" else f"{prefix}.w13_weight"
                mapping.append((param, f"{module}.{ckpt}.weight", e, shard))
        return mapping

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str, expert_id: int) -> None:
        if expert_id == self.num_experts and self.num_shared:  # the shared MLP: S experts' slices
            full = self.intermediate * self.tp.size  # one slice's width (never expert-parallel)
            dim = 1 if shard_id == "w2" else 0
            if loaded.shape[dim] != full * self.num_shared:
                raise ValueError(f"shared experts {shard_id}: shape {tuple(loaded.shape)}, expected "
                                 f"{self.num_shared} x {full} along dim {dim}")  # fmt: skip
            for s in range(self.num_shared):
                self._load_expert(param, loaded.narrow(dim, s * full, full), shard_id, len(self.local_experts) + s)
            return
        if expert_id not in self.local_experts:  # another rank's expert
            return
        self._load_expert(param, loaded, shard_id, expert_id - self.local_experts.start)

    def _load_expert(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str, index: int) -> None:
        """One expert's gate, up or down weight (the whole expert's) into local slot ``index``."""
        size = self.intermediate
        if shard_id == "w2":
            loaded = loaded.narrow(1, self.slice_rank * size, size)
            target = param.data[index]
        else:
            loaded = loaded.narrow(0, self.slice_rank * size, size)
            target = param.data[index].narrow(0, 0 if shard_id == "w1" else size, size)
        if target.shape != loaded.shape:
            raise ValueError(f"expert slot {index} {shard_id}: shape {tuple(loaded.shape)}, "
                             f"expected {tuple(target.shape)}")
        target.copy_(materialize(loaded))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = ops.moe_topk(router_logits, self.top_k, self.renormalize)
        return self.forward_routed(x, weights, ids)

    def forward_routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                       dense_shared: bool = False) -> torch.Tensor:  # fmt: skip
        """The experts for routes chosen elsewhere (e.g. DeepSeek's grouped top-k):
        ``weights`` float32 [T, k], ``ids`` int64 [T, k] (global expert ids); ``dense_shared``:
        add the shared experts as a dense MLP (before the tensor-parallel reduction, which
        then sums both)."""
        if self.tp.gathers_tokens:  # the other replicas' tokens join (padding rows: weight 0)
            (x, weights, ids), counts = self.tp.gather_rows(x, weights, ids)
        if len(self.local_experts) < self.num_experts:
            weights, ids = self._local_routes(weights, ids)
        if self.quant_method is not None:
            y = self.quant_method.apply(self, x, weights, ids)
        else:
            y = ops.fused_moe(x, self.w13_weight, self.w2_weight, weights, ids)
        if dense_shared:
            y = y + self._shared_mlp(x)
        return self.tp.reduce_scatter_rows(y, counts) if self.tp.gathers_tokens else self.tp.all_reduce(y)

    def _shared_mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts' slots as one MLP: their gate/up rows are one [S * 2I, H] view;
        the down projection sums the slices' GEMMs (accumulated in place by ``addmm``)."""
        first, inter = len(self.local_experts), self.intermediate
        gate_up = F.linear(x, self.w13_weight[first:].flatten(0, 1)).view(x.shape[0], self.num_shared, 2 * inter)
        act = ops.silu_and_mul(gate_up)  # [T, S, I]
        out = F.linear(act[:, 0], self.w2_weight[first])
        for s in range(1, self.num_shared):
            out = torch.addmm(out, act[:, s], self.w2_weight[first + s].t())
        return out

    def _local_routes(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallelism, the simple correct scheme: every rank sees every token, routes
        to another rank's expert get weight 0 (and a local expert id, so the kernel stays in
        bounds); the all-reduce then sums each token's experts across ranks. An all-to-all
        dispatch that sends each token only to its experts' ranks is the faster GPU path."""
        local = ids - self.local_experts.start
        mine = (local >= 0) & (local < len(self.local_experts))
        return weights * mine, torch.where(mine, local, 0)
