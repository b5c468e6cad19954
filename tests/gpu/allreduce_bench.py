"""All-reduce on 2+ GPUs: atom's one-shot over symmetric memory against NCCL, checked and timed.

    python tests/gpu/allreduce_bench.py [--world-size 2]

For bf16 messages of 8 KiB .. 16 MiB: the one-shot result against NCCL's (eager and replayed
from a CUDA graph, fresh inputs each time), then the time of each inside a CUDA graph of
50 all-reduces (as the decode graphs run them). A table on rank 0, JSON to $OUT.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES_KIB = [8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384]
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


def rank_main(rank: int, world: int, init: str, out: str) -> None:
    from atom.distributed.all_reduce import OneShotAllReduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    comm = OneShotAllReduce.create(dist.group.WORLD, device)
    assert comm is not None, "one-shot all-reduce could not be set up"
    big = OneShotAllReduce(dist.group.WORLD, device, max(SIZES_KIB) << 10)  # to time past the threshold

    def nccl(x):
        dist.all_reduce(x)
        return x

    rows = []
    for kib in SIZES_KIB:
        n = (kib << 10) // 2
        one = comm if comm.fits(torch.empty(n, device=device, dtype=torch.bfloat16)) else big
        torch.manual_seed(rank * 1000 + kib)
        x = torch.randn(n, device=device, dtype=torch.bfloat16)
        ref = nccl(x.clone())
        eager_ok = torch.equal(one(x), ref)
        # graph replay with new inputs copied into the captured input buffer
        buf = torch.zeros_like(x)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            one(buf)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            y = one(buf)
        graph_ok = True
        for i in range(3):
            torch.manual_seed(rank * 7 + i)
            buf.copy_(torch.randn(n, device=device, dtype=torch.bfloat16))
            g.replay()
            expected = nccl(buf.clone())
            graph_ok &= torch.equal(y, expected)
        t_nccl = graph_time_us(lambda v: dist.all_reduce(v), x.clone())
        t_one = graph_time_us(one, x.clone())
        rows.append(dict(kib=kib, eager_equal=eager_ok, graph_equal=graph_ok, nccl_us=round(t_nccl, 2),
                         one_shot_us=round(t_one, 2), speedup=round(t_nccl / t_one, 2)))
    if rank == 0:
        json.dump(rows, open(os.path.join(out, "allreduce_bench.json"), "w"), indent=1)
        print(f"\n{world} GPUs, bf16, time per all-reduce inside a CUDA graph of {REPS}")
        print("| KiB | one-shot == NCCL (eager / graph) | NCCL us | one-shot us | NCCL / one-shot |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['kib']} | {r['eager_equal']} / {r['graph_equal']} | {r['nccl_us']} | {r['one_shot_us']} | "
                  f"{r['speedup']} |")
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
