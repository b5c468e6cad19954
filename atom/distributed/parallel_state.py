"""Tensor- and expert-parallel coordinates, passed explicitly to the layers that shard, and
the process-group set-up of one rank.

Layers never ask torch.distributed for the world size in their constructors: the worker
process (or the host framework, in plugin mode) knows the rank and hands it down.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPInfo:
    """One rank's place in the tensor-parallel group. With ``expert_parallel`` the MoE layers
    place whole experts on ranks (E / size each) instead of slicing every expert; the expert
    group is the tensor-parallel group (data-parallel attention would widen it later)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup when size > 1
    expert_parallel: bool = False
    # GPUs: all_reduce.CustomAllReduce for the messages it fits (None: NCCL / gloo for all)
    custom_all_reduce: Any = None
    # data-parallel attention: the MoE layers' own group (the replicas hold different
    # tokens, gathered around each MoE layer; ``dp_attention.py``); None: this one
    moe: TPInfo | None = None
    gathers_tokens: bool = False  # set on ``moe``: each rank brings its own tokens

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside [0, {self.size})")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.custom_all_reduce is not None:
            return self.custom_all_reduce.all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather_rows(self, *tensors: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
        """Every rank's rows of each tensor (all with this rank's row count), rank after rank,
        each rank's padded to the longest (padding is zero), and the row count of each rank."""
        count = torch.tensor([tensors[0].shape[0]], device=tensors[0].device)
        counts = [torch.empty_like(count) for _ in range(self.size)]
        dist.all_gather(counts, count, group=self.group)
        counts = [int(c) for c in counts]
        gathered = []
        for x in tensors:
            padded = x.new_zeros((max(counts), *x.shape[1:]))
            padded[: x.shape[0]] = x
            gathered.append(self.all_gather(padded, dim=0))
        return gathered, counts

    def reduce_scatter_rows(self, y: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The inverse of ``gather_rows`` for a sum: every rank's partial ``y`` over all ranks'
        padded rows, summed, and this rank's own rows of it."""
        width = y.shape[0] // self.size
        if dist.get_backend(self.group) == "nccl":
            mine = y.new_empty((width, *y.shape[1:]))
            dist.reduce_scatter_tensor(mine, y.contiguous(), group=self.group)
        else:  # gloo has no reduce-scatter
            dist.all_reduce(y, group=self.group)
            mine = y[self.rank * width : (self.rank + 1) * width]
        return mine[: counts[self.rank]]

    def local_experts(self, num_experts: int) -> range:
        """Global ids of the experts this rank holds (all of them without expert parallelism)."""
        if not self.expert_parallel or self.size == 1:
            return range(num_experts)
        if num_experts % self.size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {self.size} expert-parallel ranks")
        n = num_experts // self.size
        return range(self.rank * n, (self.rank + 1) * n)


SINGLE = TPInfo()


def default_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def init_distributed(rank: int, world_size: int, init_method: str, backend: str | None = None) -> TPInfo:
    """Join the default process group (gloo on the CPU, NCCL on CUDA, one GPU per rank) and
    return this rank's coordinates (``dataclasses.replace(tp, expert_parallel=True)`` turns
    expert parallelism on); a single rank needs no group at all."""
    if world_size == 1:
        return TPInfo()
    backend = backend or default_backend("cuda" if torch.cuda.is_available() else "cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    logger.info("rank %d/%d joined the %s group (pid %d)", rank, world_size, backend, os.getpid())
    return TPInfo(rank, world_size, dist.group.WORLD)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def select_replica_gpus(tensor_parallel_size: int, data_parallel_rank: int) -> None:
    """Leave visible only this data-parallel replica's GPUs, rank-major as vLLM: replica r
    gets GPUs r*tp .. r*tp+tp-1 of those visible to the server. Must run in the replica's
    process before CUDA initialises (``device_count`` reads NVML then, and caches nothing);
    its rank processes inherit the setting."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    first = data_parallel_rank * tensor_parallel_size
    mine = ids[first:first + tensor_parallel_size]
    if len(mine) < tensor_parallel_size:
        raise ValueError(f"data-parallel replica {data_parallel_rank} needs GPUs {first}.."
                         f"{first + tensor_parallel_size - 1}; only {len(ids)} are visible")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    logger.info("data-parallel replica %d uses GPUs %s", data_parallel_rank, ",".join(mine))
