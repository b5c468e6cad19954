"""A one-shot all-reduce over symmetric memory for the small messages of decode steps.

Each rank copies its tensor into a buffer every rank can read over NVLink, waits at a
barrier, and sums all ranks' buffers in one kernel (``torch.ops.symm_mem``; no NVLink
multicast). At decode sizes (a few to a few hundred KiB) that is one short kernel where
NCCL's protocol costs several; above ``max_bytes`` NCCL's bandwidth-optimal algorithms
win and take over. CUDA graphs capture it. vLLM's custom all-reduce is the same idea.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MAX_BYTES = 1 << 20  # one-shot up to 1 MiB (a 128-token chunk of a 4096-wide bf16 model)


# An opaque op for torch.compile. ``buffer`` is written but not declared mutated, on purpose:
# functionalization would hand the op a clone, which is not symmetric memory (vLLM's
# all-reduce op hides its buffer the same way); nothing else in a graph reads it.
@torch.library.custom_op("atom::one_shot_all_reduce", mutates_args=())
def _one_shot(buffer: torch.Tensor, x: torch.Tensor, group_name: str) -> torch.Tensor:
    flat = buffer[: x.numel() * x.element_size()].view(x.dtype)
    return torch.ops.symm_mem.one_shot_all_reduce_copy(flat, x.reshape(-1), "sum", group_name).view(x.shape)


@_one_shot.register_fake
def _(buffer, x, group_name):
    return torch.empty_like(x)


class OneShotAllReduce:
    """Sum ``x`` over the group through symmetric memory (``fits(x)`` says whether it may)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, max_bytes: int = MAX_BYTES):
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name, self.max_bytes = group.group_name, max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.numel() * x.element_size() <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _one_shot(self.buffer, x.contiguous(), self.group_name)

    @classmethod
    def create(cls, group: dist.ProcessGroup, device: torch.device) -> OneShotAllReduce | None:
        """The communicator, checked against NCCL on this group; None (NCCL everywhere) where
        symmetric memory cannot be set up (no P2P between the GPUs, an old driver)."""
        comm, why = None, None
        try:
            comm = cls(group, device)
            x = torch.arange(4096, device=device, dtype=torch.bfloat16) * (dist.get_rank(group) + 1) / 4096
            expected = x.clone()
            dist.all_reduce(expected, group=group)
            why = None if torch.allclose(comm(x), expected, rtol=1e-2) else "it disagreed with NCCL"
        except Exception as e:  # any failure leaves NCCL in charge
            why = f"{type(e).__name__}: {e}"
        ok = torch.tensor([why is None], dtype=torch.int32, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank takes the same path
        if not ok.item():
            logger.warning("one-shot all-reduce unavailable (%s); NCCL runs every all-reduce", why or "on a peer")
            return None
        logger.info("one-shot all-reduce over symmetric memory for messages up to %d KiB", comm.max_bytes >> 10)
        return comm
