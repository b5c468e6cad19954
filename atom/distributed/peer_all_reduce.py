"""An all-reduce in one Triton kernel that reads the peers' symmetric buffers directly.

torch's ``one_shot_all_reduce_copy`` runs a copy, a barrier and a reduction with a fixed small
grid; at the 1-8 MiB of a decode step's all-reduce (256 rows x 4096 x bf16 = 2 MiB) it gains
little on NCCL and loses above 4 MiB (2 x H100: 1.45x at 2 MiB, 0.80x at 8 MiB; this kernel
2.1x and 1.4x, docs/performance.md). This kernel fuses the three: each program copies its
slices of the input into this rank's symmetric buffer, meets the same program of every other
rank at a barrier on the signal pads, sums its slices over all ranks' buffers (same order on
every rank, float32, so all ranks hold identical results), and meets them again before the
buffer may be written by the next call. The barrier is the compare-and-swap handshake of
PyTorch's symmetric-memory kernels: the pads return to zero after each use, so a CUDA graph
can replay it. NVIDIA GPUs with peer access only (inline PTX); not run by the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _flat_tid():
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _send(addrs, SEM: tl.constexpr):  # set a peer's slot 0 -> 1 (spins while it is still 1)
    tl.inline_asm_elementwise(
        f"""{{
        .reg .u32 %t;
        .reg .pred %p;
        send:
            atom.global.{SEM}.sys.cas.b32 %t, [$1], 0, 1;
            setp.eq.u32 %p, %t, 0;
            @!%p bra send;
        }}""",
        "=r, l", [addrs], dtype=tl.uint32, is_pure=False, pack=1)


@triton.jit
def _wait(addrs, SEM: tl.constexpr):  # take this rank's slot 1 -> 0 (spins until a peer set it)
    tl.inline_asm_elementwise(
        f"""{{
        .reg .u32 %t;
        .reg .pred %p;
        wait:
            atom.global.sys.{SEM}.cas.b32 %t, [$1], 1, 0;
            setp.eq.u32 %p, %t, 1;
            @!%p bra wait;
        }}""",
        "=r, l", [addrs], dtype=tl.uint32, is_pure=False, pack=1)


@triton.jit
def _barrier(pad_ptrs, block, RANK: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BEFORE: tl.constexpr,
             AFTER: tl.constexpr):
    """Program ``block`` of every rank meets here. BEFORE: this program's earlier writes are
    released to the peers; AFTER: the peers' earlier writes are acquired by this program.
    Thread t < W signals rank t and waits for it (ranks padded to a power of two for arange)."""
    ranks = tl.arange(0, WP)
    pads = pad_ptrs.to(tl.pointer_type(tl.uint64))
    remote = tl.load(pads + ranks, mask=ranks < W, other=0).to(tl.pointer_type(tl.uint32)) + block * W + RANK
    local = tl.load(pads + RANK).to(tl.pointer_type(tl.uint32)) + block * W + ranks
    if BEFORE:
        tl.debug_barrier()
    if _flat_tid() < W:
        _send(remote, "release" if BEFORE else "relaxed")
        _wait(local, "acquire" if AFTER else "relaxed")
    if AFTER:
        tl.debug_barrier()


@triton.jit
def _peer_all_reduce_kernel(x_ptr, out_ptr, bufs, pad_ptrs, epochs, numel, half, RANK: tl.constexpr,
                            W: tl.constexpr, WP: tl.constexpr, BLOCK: tl.constexpr, DOUBLE: tl.constexpr):
    # ``bufs``: every rank's buffer as a tensor argument (not loaded pointers), so that the
    # compiler knows their alignment and issues 16-byte loads
    pid, programs = tl.program_id(0), tl.num_programs(0)
    base = 0
    if DOUBLE:  # this call's half of the buffers: the other one may still be read by a peer's last call
        epoch = tl.load(epochs + pid)
        base = (epoch % 2) * half
    local = bufs[RANK] + base
    for b in range(pid, tl.cdiv(numel, BLOCK), programs):  # block-aligned offsets: 16-byte accesses
        offs = b * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        tl.store(local + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    _barrier(pad_ptrs, pid, RANK, W, WP, True, True)
    for b in range(pid, tl.cdiv(numel, BLOCK), programs):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(W):
            acc += tl.load(bufs[r] + base + offs, mask=mask).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    if DOUBLE:
        tl.store(epochs + pid, epoch + 1)
    else:  # no rank may write its buffer again before every peer has read it
        _barrier(pad_ptrs, pid, RANK, W, WP, True, False)


class PeerAllReduce:
    """Sum ``x`` over the group in one kernel over a symmetric buffer of ``max_bytes``.

    ``double_buffer``: alternate between the buffer's two halves (messages up to half of
    ``max_bytes``) and skip the closing barrier. Rank A's call N+1 writes the half that the
    peers read in call N-1, which every peer has finished: a peer's call N started (A met it
    at call N's barrier) only after its call N-1 ended. Each program keeps its own call count
    on the device (CUDA graphs replay it), so the grid is fixed: every program takes part in
    every call and all counts stay equal."""

    BLOCK, WARPS = 4096, 16

    def __init__(self, group, device: torch.device, max_bytes: int, double_buffer: bool = False):
        from torch.distributed import _symmetric_memory as symm_mem

        self.max_bytes, self.double = max_bytes, double_buffer
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group.group_name)
        self.rank, self.world = self.handle.rank, self.handle.world_size
        # one uint32 slot per (program, peer) in the signal pad bounds the grid
        self.max_programs = min(256, self.handle.signal_pad_size // (4 * self.world),
                                torch.cuda.get_device_properties(device).multi_processor_count)
        self.epochs = torch.zeros(self.max_programs, dtype=torch.int32, device=device)
        self.views: dict[torch.dtype, tuple[torch.Tensor, ...]] = {}  # every rank's buffer, by dtype
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            n = max_bytes // dtype.itemsize
            self.views[dtype] = tuple(self.handle.get_buffer(r, (n,), dtype) for r in range(self.world))

    def fits(self, x: torch.Tensor) -> bool:
        limit = self.max_bytes // 2 if self.double else self.max_bytes
        return x.is_cuda and x.dtype in self.views and x.numel() * x.element_size() <= limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        programs = self.max_programs if self.double else min(triton.cdiv(x.numel(), self.BLOCK), self.max_programs)
        half = self.max_bytes // 2 // x.element_size()  # a multiple of BLOCK: aligned accesses in both halves
        _peer_all_reduce_kernel[(max(1, programs),)](
            x, out, self.views[x.dtype], self.handle.signal_pad_ptrs_dev, self.epochs, x.numel(), half,
            RANK=self.rank, W=self.world, WP=triton.next_power_of_2(self.world), BLOCK=self.BLOCK,
            DOUBLE=self.double, num_warps=self.WARPS,
        )  # fmt: skip
        return out
