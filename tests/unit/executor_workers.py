"""A worker for the executor's lifetime tests, in a module that imports next to nothing, so
spawned ranks start quickly."""

import os


class EchoWorker:
    def __init__(self, tp):
        self.rank = tp.rank

    def pid(self) -> int:
        return os.getpid()

    def crash(self) -> None:
        os._exit(3)

    def fail(self) -> None:
        raise ValueError(f"bad request on rank {self.rank}")
