"""The KV cache's share of a GPU, counted per engine instance as vLLM counts it: what this
engine adds to the device between its start and the end of its profile run, so other
processes on the GPU, or other engines in the same process, do not shrink its budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    free: int  # bytes the driver reports free on the device
    total: int
    allocated: int  # bytes torch's allocator hands out now (every engine of the process)
    peak: int  # the allocator's peak since its last reset
    reserved: int  # bytes torch's allocator holds, handed out or cached

    @property
    def non_torch(self) -> int:
        """Used on the device but not through this process's allocator: CUDA context, NCCL,
        cuBLAS workspaces, and other processes."""
        return self.total - self.free - self.reserved

    @property
    def available(self) -> int:
        """Free on the device or cached by this process's allocator (reusable without the driver)."""
        return self.free + self.reserved - self.allocated

    @classmethod
    def take(cls, device: torch.device) -> MemorySnapshot:
        free, total = torch.cuda.mem_get_info(device)
        stats = torch.cuda.memory_stats(device)
        # an allocator that has not allocated yet reports no statistics
        return cls(free, total, stats.get("allocated_bytes.all.current", 0), stats.get("allocated_bytes.all.peak", 0),
                   stats.get("reserved_bytes.all.current", 0))  # fmt: skip


def check_startup_memory(start: MemorySnapshot, utilization: float) -> None:
    """vLLM's start-up check: the share asked for must be free when the engine starts."""
    if start.available < utilization * start.total:
        raise ValueError(f"free memory on the device ({start.available / GIB:.2f}/{start.total / GIB:.2f} GiB) "
                         f"at start-up is less than gpu_memory_utilization ({utilization}, "
                         f"{utilization * start.total / GIB:.2f} GiB): lower gpu_memory_utilization or free memory "
                         "used by other processes")  # fmt: skip


@dataclass(frozen=True, slots=True)
class KVBudget:
    weights: int  # this engine's tensors after the profile run (weights and buffers)
    activations: int  # the profile run's peak above them
    non_torch: int  # what the device lost outside torch's allocator since the start
    kv_cache: int  # bytes left for the KV cache (may be negative: no room)


def kv_cache_budget(start: MemorySnapshot, now: MemorySnapshot, utilization: float) -> KVBudget:
    """``utilization * total`` minus what this engine added since ``start``: its allocations'
    peak (weights plus the largest batch's activations; the allocator's peak was reset before
    the profile run) and the device memory it took outside the allocator. Cached-but-free
    allocator blocks count as neither: counting them too took the activations twice."""
    weights = now.allocated - start.allocated
    peak = now.peak - start.allocated
    non_torch = max(0, now.non_torch - start.non_torch)
    return KVBudget(weights, peak - weights, non_torch, int(utilization * now.total) - non_torch - peak)


def no_room_message(b: KVBudget, utilization: float, total: int) -> str:
    """Why the KV cache got no memory, in the numbers that decided it."""
    return (
        f"no memory left for the KV cache: gpu_memory_utilization {utilization} is {utilization * total / GIB:.2f} "
        f"GiB, of which this engine's weights and buffers take {b.weights / GIB:.2f}, the profile run's activations "
        f"{b.activations / GIB:.2f} and memory outside torch's allocator {b.non_torch / GIB:.2f} (CUDA context and "
        "libraries, or another process that allocated while this engine started); lower max_num_batched_tokens or "
        "raise gpu_memory_utilization"
    )
