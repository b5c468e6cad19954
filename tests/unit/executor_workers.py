"""A worker for the executor's lifetime tests, in a module that imports next to nothing, so
spawned ranks start quickly."""

import os


class EchoWorker:
    def __init__(self, tp):
        self.rank, self.stored = tp.rank, []

    def store(self, value) -> None:
        self.stored.append(value)

    def get(self) -> list:
        return self.stored

    def pid(self) -> int:
        return os.getpid()

    def crash(self) -> None:
        os._exit(3)

    def fail(self) -> None:
        raise ValueError(f"bad request on rank {self.rank}")
