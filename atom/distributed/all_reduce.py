"""The custom all-reduce for tensor-parallel GPUs: one fused Triton kernel over symmetric
memory (``peer_all_reduce.PeerAllReduce``) for the messages of decode and mixed steps, NCCL
above ``MAX_BYTES`` (long prefill chunks, where NCCL's bandwidth-optimal rings win).

``torch.ops.atom.all_reduce`` is the opaque op torch.compile sees (level 3), so the fast path
runs inside the compiled and captured graphs too, as vLLM's ``vllm.all_reduce`` does. The op
takes the group's name, not the symmetric buffer: a buffer passed through a compiled graph
may be handed to the op as a functionalization copy, which is not symmetric memory.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MAX_BYTES = 8 << 20  # 1,024 rows of a 4096-wide bf16 model

# communicators by group name, for the op (custom ops take tensors and plain values only);
# written once per group by ``CustomAllReduce.create``
_BY_GROUP: dict[str, CustomAllReduce] = {}


@torch.library.custom_op("atom::all_reduce", mutates_args=())
def all_reduce_op(x: torch.Tensor, group_name: str) -> torch.Tensor:
    comm = _BY_GROUP[group_name]
    if comm.peer.fits(x):
        return comm.peer(x)
    out = x.clone()  # the op returns a new tensor: NCCL runs in place on a copy
    dist.all_reduce(out, group=comm.group)
    return out


@all_reduce_op.register_fake
def _(x, group_name):
    return torch.empty_like(x)


class CustomAllReduce:
    """Sum ``x`` over ``group`` with the peer kernel where it fits, NCCL elsewhere."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, max_bytes: int = MAX_BYTES):
        from atom.distributed.peer_all_reduce import PeerAllReduce

        self.group, self.group_name = group, group.group_name
        self.peer = PeerAllReduce(group, device, max_bytes)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the group: the op under torch.compile, else a direct call
        (NCCL in place above the size limit)."""
        if torch.compiler.is_compiling():
            return torch.ops.atom.all_reduce(x, self.group_name)
        if self.peer.fits(x):
            return self.peer(x)
        dist.all_reduce(x, group=self.group)
        return x

    def _agrees_with_nccl(self, device: torch.device) -> bool:
        """The kernel's sums equal NCCL's at a few sizes (odd ones included): bf16 and float32."""
        rank, ok = dist.get_rank(self.group), True
        for n, dtype in ((4096, torch.bfloat16), (3 * 4096 + 8, torch.bfloat16), (1 << 20, torch.bfloat16),
                         (1000, torch.float32)):
            gen = torch.Generator(device=device).manual_seed(1234 + rank)
            x = torch.randn(n, device=device, dtype=dtype, generator=gen)
            expected = x.clone()
            dist.all_reduce(expected, group=self.group)
            ok &= torch.allclose(self.peer(x).float(), expected.float(), rtol=1e-2, atol=1e-2)
        return ok

    @classmethod
    def create(cls, group: dist.ProcessGroup, device: torch.device) -> CustomAllReduce | None:
        """The communicator, checked against NCCL on this group; None (NCCL everywhere) where
        it cannot be set up (no P2P between the GPUs, an old driver) or disagrees."""
        comm, why = None, None
        try:
            comm = cls(group, device)
            why = None if comm._agrees_with_nccl(device) else "it disagreed with NCCL"
        except Exception as e:  # any failure leaves NCCL in charge
            why = f"{type(e).__name__}: {e}"
        ok = torch.tensor([why is None], dtype=torch.int32, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank takes the same path
        if not ok.item():
            logger.warning("custom all-reduce unavailable (%s); NCCL runs every all-reduce", why or "on a peer")
            return None
        _BY_GROUP[comm.group_name] = comm
        logger.info("custom all-reduce (fused peer kernel over symmetric memory) for messages up to %d KiB",
                    comm.peer.max_bytes >> 10)
        return comm
