"""Data-parallel attention (``--enable-dp-attention`` with ``-dp N``): N replicas attend over
their own requests with whole heads, and the MoE layers run expert-parallel over all of them.

Each replica's engine-core process joins one group of N ranks. Around every MoE layer the
replicas gather each other's tokens, each runs its ``E / N`` experts on all of them, and a
reduce-scatter returns each replica its own rows (``TPInfo.gather_rows`` /
``reduce_scatter_rows``). So every replica must run a forward whenever any replica does:
``Lockstep.round`` is the per-step meeting where they find out, and a replica with nothing
to run sends one padding token through the model (``ModelRunner.dummy_forward``).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from atom.config import Config
from atom.distributed.parallel_state import TPInfo, default_backend

logger = logging.getLogger(__name__)


class Lockstep:
    """One all-reduce per engine-core loop iteration over the replicas (gloo, on the host)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def round(self, busy: bool, stopping: bool) -> tuple[bool, bool]:
        """(any replica has work, any replica is shutting down): every replica calls this
        once per iteration, so their forwards pair up."""
        flags = torch.tensor([int(busy), int(stopping)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flags[0]), bool(flags[1])


def init_dp_attention(config: Config) -> tuple[TPInfo, Lockstep]:
    """Join the replicas' group; the model's ``TPInfo`` (one rank for attention and dense
    layers, the replicas' group for the experts) and the replicas' ``Lockstep``."""
    pc = config.parallel_config
    backend = default_backend(config.device.type)
    dist.init_process_group(backend, init_method=pc.dp_init_method, rank=pc.data_parallel_rank,
                            world_size=pc.data_parallel_size)
    sync = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    logger.info("data-parallel attention: replica %d of %d, experts over all replicas (%s)", pc.data_parallel_rank,
                pc.data_parallel_size, backend)
    moe = TPInfo(pc.data_parallel_rank, pc.data_parallel_size, dist.group.WORLD, expert_parallel=True,
                 gathers_tokens=True)
    return TPInfo(moe=moe), Lockstep(sync)
