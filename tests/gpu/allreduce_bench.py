"""All-reduce on 2+ GPUs: atom's custom all-reduce (the fused peer kernel,
``atom/distributed/peer_all_reduce.py``, with two barriers a call or double-buffered with one)
and torch's one-shot over symmetric memory against NCCL, checked and timed.

    python tests/gpu/allreduce_bench.py [--world-size 2]

First the engine's path: ``CustomAllReduce.create`` (its own check against NCCL), then
``torch.ops.atom.all_reduce`` inside a ``torch.compile``d function replayed from a CUDA graph,
as level 3 runs it. Then, for bf16 messages of 8 KiB .. 16 MiB: each result against NCCL's
(eager and replayed from a CUDA graph, fresh inputs each time), and the time of each inside a
CUDA graph of 50 all-reduces (as the decode graphs run them). A table on rank 0, JSON to $OUT.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES_KIB = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
REPS = 50


def graph_time_us(fn, x: torch.Tensor) -> float:
    """Microseconds per call of ``fn(x)``, captured REPS times in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(x)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn(x)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        dist.barrier()
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPS)
    return sorted(times)[len(times) // 2]


def nccl(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def check(fn, n: int, rank: int, device: torch.device) -> tuple[bool, bool]:
    """``fn`` equal to NCCL eagerly, and replayed from a CUDA graph with new inputs copied into
    the captured input buffer (three replays)."""
    torch.manual_seed(rank * 1000 + n)
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    eager_ok = torch.equal(fn(x), nccl(x.clone()))
    buf = torch.zeros_like(x)
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(buf)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        y = fn(buf)
    graph_ok = True
    for i in range(3):
        torch.manual_seed(rank * 7 + i)
        buf.copy_(torch.randn(n, device=device, dtype=torch.bfloat16))
        g.replay()
        graph_ok &= torch.equal(y, nccl(buf.clone()))
    return eager_ok, graph_ok


class TorchOneShot:
    """torch's one-shot all-reduce over symmetric memory, for comparison."""

    def __init__(self, group, device, max_bytes: int):
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.buffer[: x.numel() * x.element_size()].view(x.dtype)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(flat, x.reshape(-1), "sum", self.group_name).view(x.shape)


def compiled_path_ok(tp, device: torch.device) -> bool:
    """``TPInfo.all_reduce`` inside torch.compile, eager then replayed from a CUDA graph, equal
    to NCCL; sizes under and over the custom kernel's limit."""
    f = torch.compile(lambda x: tp.all_reduce(x * 2) + 1, dynamic=True)
    ok = True
    for rows in (1, 256, 3000):
        x = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16)
        want = x * 2
        dist.all_reduce(want)
        ok &= torch.allclose(f(x).float(), (want + 1).float(), rtol=1e-2, atol=1e-2)
        buf = x.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            f(buf)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = f(buf)
        buf.copy_(torch.randn_like(buf))
        g.replay()
        want = buf * 2
        dist.all_reduce(want)
        ok &= torch.allclose(y.float(), (want + 1).float(), rtol=1e-2, atol=1e-2)
    return ok


def rank_main(rank: int, world: int, init: str, out: str) -> None:
    from atom.distributed.all_reduce import CustomAllReduce
    from atom.distributed.parallel_state import TPInfo
    from atom.distributed.peer_all_reduce import PeerAllReduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    comm = CustomAllReduce.create(dist.group.WORLD, device)
    assert comm is not None, "the custom all-reduce could not be set up (see the warning)"
    tp = TPInfo(rank, world, dist.group.WORLD, custom_all_reduce=comm)
    compiled_ok = compiled_path_ok(tp, device)
    if rank == 0:
        print(f"engine path: CustomAllReduce.create ok; inside torch.compile + CUDA graph equal to NCCL: {compiled_ok}",
              flush=True)
    one = TorchOneShot(dist.group.WORLD, device, max(SIZES_KIB) << 10)
    peer = PeerAllReduce(dist.group.WORLD, device, max(SIZES_KIB) << 10)
    double = PeerAllReduce(dist.group.WORLD, device, max(SIZES_KIB) << 11, double_buffer=True)

    rows = []
    for kib in SIZES_KIB:
        n = (kib << 10) // 2
        row = dict(kib=kib)
        for name, fn in (("one_shot", one), ("peer", peer), ("double", double)):
            try:
                eager, graph = check(fn, n, rank, device)
                row[f"{name}_equal"] = f"{eager} / {graph}"
                row[f"{name}_us"] = round(graph_time_us(fn, torch.randn(n, device=device, dtype=torch.bfloat16)), 2)
            except Exception as e:  # one failing implementation must not hide the others
                row[f"{name}_equal"], row[f"{name}_us"] = f"{type(e).__name__}: {e}"[:60], float("nan")
        row["nccl_us"] = round(graph_time_us(nccl, torch.randn(n, device=device, dtype=torch.bfloat16)), 2)
        rows.append(row)
    if rank == 0:
        with open(os.path.join(out, "allreduce_bench.json"), "w") as f:
            json.dump(dict(compiled_ok=compiled_ok, rows=rows), f, indent=1)
        print(f"\n{world} GPUs, bf16, time per all-reduce inside a CUDA graph of {REPS}")
        print("| KiB | one-shot == NCCL (eager / graph) | peer == NCCL | double == NCCL | NCCL us | one-shot us "
              "| peer us | double us | NCCL / one-shot | NCCL / peer | NCCL / double |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['kib']} | {r['one_shot_equal']} | {r['peer_equal']} | {r['double_equal']} | {r['nccl_us']} | "
                  f"{r['one_shot_us']} | {r['peer_us']} | {r['double_us']} | {r['nccl_us'] / r['one_shot_us']:.2f} | "
                  f"{r['nccl_us'] / r['peer_us']:.2f} | {r['nccl_us'] / r['double_us']:.2f} |")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    args = p.parse_args()
    out = os.environ.get("OUT", "gpu-results")
    os.makedirs(out, exist_ok=True)
    init = f"file:///tmp/atom-allreduce-{os.getpid()}"
    mp.spawn(rank_main, args=(args.world_size, init, out), nprocs=args.world_size)


if __name__ == "__main__":
    main()
