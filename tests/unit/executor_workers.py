"""A worker for the executor's lifetime tests, in a module that imports next to nothing, so
spawned ranks start quickly."""

import logging
import os
import time


class EchoWorker:
    def __init__(self, tp):
        self.rank, self.stored = tp.rank, []

    def store(self, value) -> None:
        self.stored.append(value)

    def get(self) -> list:
        return self.stored

    def pid(self) -> int:
        return os.getpid()

    def log(self, message: str) -> None:
        logging.getLogger("atom.test").info(message)

    def crash(self) -> None:
        os._exit(3)

    def fail(self) -> None:
        raise ValueError(f"bad request on rank {self.rank}")

    def fail_as_peer_dies(self) -> None:
        """Rank 0 raises at once, as its collective does when a peer is killed; the peer (rank 1)
        is seen dead a moment later."""
        if self.rank == 0:
            raise RuntimeError("gloo: Read error (the peer closed the connection)")
        time.sleep(0.2)
        os._exit(9)


class AllReduceWorker:
    """Runs ``TPInfo.all_reduce`` with a custom communicator in place, eagerly and inside
    torch.compile. The GPU kernel cannot run on the CPU: a gloo sum in the kernel's place
    records which messages reached it, so the test checks the dispatch around it."""

    def __init__(self, tp):
        import dataclasses

        import torch.distributed as dist

        from atom.distributed import all_reduce

        class GlooKernel:  # the fused peer kernel's interface: fits(x), __call__(x) -> new tensor
            max_bytes = 4096 * 4
            calls: list[int] = []

            def fits(self, x):
                return x.numel() * x.element_size() <= self.max_bytes

            def __call__(self, x):
                self.calls.append(x.numel())
                out = x.clone()
                dist.all_reduce(out, group=tp.group)
                return out

        comm = all_reduce.CustomAllReduce.__new__(all_reduce.CustomAllReduce)
        comm.group, comm.group_name, comm.peer = tp.group, tp.group.group_name, GlooKernel()
        all_reduce._BY_GROUP[comm.group_name] = comm
        self.tp, self.kernel = dataclasses.replace(tp, custom_all_reduce=comm), comm.peer

    def run(self, compiled: bool, rows_list: list[int]) -> tuple[list, list[int]]:
        import torch

        def f(x):
            return self.tp.all_reduce(x * 2) + 1

        fn = torch.compile(f, dynamic=True, backend="aot_eager") if compiled else f
        outs = []
        for rows in rows_list:
            x = torch.arange(rows * 4096, dtype=torch.float32).reshape(rows, 4096) * (self.tp.rank + 1)
            outs.append(fn(x))
        calls, self.kernel.calls[:] = list(self.kernel.calls), []
        return outs, calls
