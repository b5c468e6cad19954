"""The KV cache budget counts only what this engine adds to the GPU (vLLM's per-instance
gpu_memory_utilization), checked on the arithmetic: the snapshots are plain numbers."""

import pytest

from atom.worker.memory import GIB, MemorySnapshot, check_startup_memory, kv_cache_budget, no_room_message

TOTAL = 100 * GIB


def snap(used_elsewhere: int, allocated: int, peak: int, reserved: int) -> MemorySnapshot:
    """A device of TOTAL bytes: ``used_elsewhere`` outside this process's allocator."""
    return MemorySnapshot(free=TOTAL - used_elsewhere - reserved, total=TOTAL, allocated=allocated, peak=peak,
                          reserved=reserved)  # fmt: skip


def test_alone_on_the_device():
    start = snap(used_elsewhere=GIB // 2, allocated=0, peak=0, reserved=0)  # the CUDA context
    # 16 GiB of weights, a 4 GiB activation peak, 1 GiB of cuBLAS/NCCL workspaces, 2 GiB cached-but-free
    now = snap(used_elsewhere=GIB // 2 + GIB, allocated=16 * GIB, peak=20 * GIB, reserved=22 * GIB)
    b = kv_cache_budget(start, now, 0.9)
    assert (b.weights, b.activations, b.non_torch) == (16 * GIB, 4 * GIB, GIB)
    assert b.kv_cache == int(0.9 * TOTAL) - 21 * GIB


def test_other_processes_and_engines_do_not_shrink_the_budget():
    # 40 GiB held by another process, 30 GiB by an earlier engine of this process
    start = snap(used_elsewhere=40 * GIB, allocated=30 * GIB, peak=30 * GIB, reserved=30 * GIB)
    now = snap(used_elsewhere=41 * GIB, allocated=46 * GIB, peak=50 * GIB, reserved=52 * GIB)
    alone = kv_cache_budget(snap(0, 0, 0, 0), snap(GIB, 16 * GIB, 20 * GIB, 22 * GIB), 0.3)
    check_startup_memory(start, 0.3)  # 30 GiB free
    assert kv_cache_budget(start, now, 0.3) == alone
    assert alone.kv_cache == int(0.3 * TOTAL) - 21 * GIB > 0


def test_no_room_is_a_negative_budget():
    b = kv_cache_budget(snap(0, 0, 0, 0), snap(0, 9 * GIB, 12 * GIB, 12 * GIB), 0.1)
    assert b.kv_cache < 0


def test_no_room_names_what_took_the_share():
    # another process grew by 30 GiB while this engine started (seen on an H200 beside an hf run)
    b = kv_cache_budget(snap(10 * GIB, 0, 0, 0), snap(40 * GIB, GIB, 3 * GIB, 3 * GIB), 0.25)
    assert b.kv_cache < 0
    msg = no_room_message(b, 0.25, TOTAL)
    assert "gpu_memory_utilization 0.25 is 25.00 GiB" in msg
    assert "weights and buffers take 1.00, the profile run's activations 2.00" in msg
    assert "outside torch's allocator 30.00" in msg and "another process" in msg


def test_startup_check_wants_the_share_free():
    check_startup_memory(snap(used_elsewhere=10 * GIB, allocated=0, peak=0, reserved=0), 0.9)
    # an earlier engine's memory, freed but still cached by the allocator, counts as free
    check_startup_memory(snap(used_elsewhere=GIB, allocated=GIB, peak=GIB, reserved=40 * GIB), 0.9)
    with pytest.raises(ValueError):
        check_startup_memory(snap(used_elsewhere=GIB, allocated=39 * GIB, peak=GIB, reserved=40 * GIB), 0.9)
    with pytest.raises(ValueError, match=r"free memory on the device \(30.00/100.00 GiB\).*gpu_memory_utilization"):
        check_startup_memory(snap(used_elsewhere=70 * GIB, allocated=0, peak=0, reserved=0), 0.5)
