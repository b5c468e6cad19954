"""One worker process per tensor-parallel rank, and the executor that owns their lifetime.

``MultiprocExecutor(world_size, make_worker)`` spawns the ranks; each joins the process
group (``init_distributed``) and builds its worker with ``make_worker(tp)``. Then
``collective_rpc("method", *args)`` runs ``worker.method(*args)`` on every rank, in step,
and returns rank 0's result (the other ranks reply with an acknowledgement only, so a
batch of logits crosses the pipe once); ``post("method", *args)`` queues a call without
waiting for it. ``rank_worker.RankWorker`` is the engine's worker.

No orphans: a rank that dies or raises makes the executor kill the whole group and raise
``RankFailure`` in the caller; a rank whose parent disappears (SIGKILL, SIGTERM) exits on
its own, from the closed pipe or from a watchdog thread when it is busy in a collective.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.multiprocessing as mp

from atom.distributed.parallel_state import TPInfo, destroy_distributed, init_distributed

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5
SHUTDOWN_GRACE_S = 5.0


class RankFailure(RuntimeError):
    """A rank died or raised; the executor has already stopped every rank."""


@dataclass(frozen=True, slots=True)
class RpcRequest:
    method: str
    args: tuple = ()
    kwargs: dict | None = None
    reply: bool = True  # False: posted (``post``); only a failure is answered


@dataclass(frozen=True, slots=True)
class RpcReply:
    rank: int
    value: Any = None  # rank 0's return value; None from the other ranks
    error: str | None = None  # the remote traceback when the method raised


_SHUTDOWN = RpcRequest("__shutdown__")


@dataclass(frozen=True, slots=True)
class RankSpec:
    """Everything a spawned rank needs; pickled into the child."""

    rank: int
    world_size: int
    init_method: str
    backend: str | None
    parent_pid: int
    log_level: int = logging.WARNING  # the parent's: a spawned process starts with no logging set up


class MultiprocExecutor:
    def __init__(self, world_size: int, make_worker: Callable[[TPInfo], Any], backend: str | None = None,
                 start_timeout_s: float = 120.0):
        """``make_worker`` must be picklable (a module-level class or function): it runs in
        each spawned rank with that rank's ``TPInfo``."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._rendezvous = tempfile.mkdtemp(prefix="atom-tp-")
        init_method = f"file://{os.path.join(self._rendezvous, 'store')}"
        ctx = mp.get_context("spawn")
        self._procs, self._conns = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            spec = RankSpec(rank, world_size, init_method, backend, os.getpid(),
                            logging.getLogger().getEffectiveLevel())
            proc = ctx.Process(target=_rank_main, args=(spec, make_worker, child), name=f"atom-rank-{rank}",
                               daemon=True)
            proc.start()
            child.close()  # the child's end lives in the child only, so its death closes the pipe
            self._procs.append(proc)
            self._conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop_ranks, self._procs, self._conns, self._rendezvous)
        self._collect(start_timeout_s, "start-up")
        logger.info("%d ranks started: pids %s", world_size, [p.pid for p in self._procs])

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def collective_rpc(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> Any:
        """Run ``method`` on every rank's worker and return rank 0's result. Raises
        ``RankFailure`` (after stopping all ranks) if any rank died or raised."""
        self._send(RpcRequest(method, args, kwargs or None))
        return self._collect(timeout_s, method)

    def post(self, method: str, *args, **kwargs) -> None:
        """Queue ``method`` on every rank without waiting for it: the ranks run their calls
        in order, so a later ``collective_rpc`` sees its effects; a rank that fails in it
        answers with the error, which that ``collective_rpc`` raises."""
        self._send(RpcRequest(method, args, kwargs or None, reply=False))

    def _send(self, request: RpcRequest) -> None:
        if not self._finalizer.alive:
            raise RankFailure("the executor is shut down")
        # pickled once for every rank (a step of 256 requests takes ~2 ms to pickle); plain
        # pickle copies a tensor's bytes where ``send`` would share its storage by a
        # file descriptor that only one receiver could take
        data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                self._fail(f"{request.method}: {self._gone(rank)}")

    def _collect(self, timeout_s: float | None, what: str) -> Any:
        """One reply per rank; watches the processes too, so a dead rank is noticed at once."""
        pending = dict(enumerate(self._conns))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        result = None
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self._fail(f"{what}: ranks {sorted(pending)} did not answer within {timeout_s} s")
            sentinels = {self._procs[r].sentinel: r for r in pending}
            ready = wait([*pending.values(), *sentinels], left)
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels[obj]
                    if not self._conns[rank].poll():  # died without a last word
                        self._fail(f"{what}: {self._gone(rank)}")
                    continue
                rank = next(r for r, c in pending.items() if c is obj)
                try:
                    reply: RpcReply = obj.recv()
                except (EOFError, ConnectionResetError):  # reset: it died with our request unread
                    self._fail(f"{what}: {self._gone(rank)}")
                if reply.error is not None:
                    # a rank that dies breaks its peers' collectives: their errors (gloo's "Read
                    # error", NCCL's) may come first, but the death is the cause to report
                    dead = self._dead_peer(reply.rank)
                    self._fail(f"{what}: {self._gone(dead)}" if dead is not None
                               else f"{what}: rank {reply.rank} raised:\n{reply.error}")  # fmt: skip
                if reply.rank == 0:
                    result = reply.value
                del pending[rank]
        return result

    def _dead_peer(self, rank: int, grace_s: float = 1.0) -> int | None:
        """A rank other than ``rank`` that died (killed or crashed: a non-zero exit code; a rank
        that raised exits cleanly after its reply), waiting up to ``grace_s`` for one; or None."""
        sentinels = {self._procs[r].sentinel: r for r in range(self.world_size) if r != rank}
        deadline = time.monotonic() + grace_s
        while sentinels and (left := deadline - time.monotonic()) > 0:
            for s in wait(list(sentinels), left):
                proc = self._procs[sentinels.pop(s)]
                proc.join(SHUTDOWN_GRACE_S)
                if proc.exitcode:
                    return self._procs.index(proc)
        return None

    def _gone(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(SHUTDOWN_GRACE_S)  # its pipe may close a moment before it can be reaped
        return f"rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}"

    def _fail(self, message: str) -> None:
        logger.error("%s; stopping all %d ranks", message, self.world_size)
        self._finalizer()
        raise RankFailure(message)

    def shutdown(self) -> None:
        """Ask every rank to leave, then kill what is left after a grace period. Idempotent."""
        self._finalizer()

    def __enter__(self) -> MultiprocExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _stop_ranks(procs: list, conns: list[Connection], rendezvous: str) -> None:
    for conn in conns:
        try:
            conn.send(_SHUTDOWN)
        except OSError:
            pass
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(SHUTDOWN_GRACE_S)
    for conn in conns:
        conn.close()
    shutil.rmtree(rendezvous, ignore_errors=True)


# the rank process
def _rank_main(spec: RankSpec, make_worker: Callable[[TPInfo], Any], conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    ignore_sigterm_while_parent_lives(spec.parent_pid)  # so does a group SIGTERM
    logging.basicConfig(level=spec.log_level, format=f"%(levelname)s [rank {spec.rank}] %(name)s: %(message)s")
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True, name="parent-watch").start()
    try:
        tp = init_distributed(spec.rank, spec.world_size, spec.init_method, spec.backend)
        worker = make_worker(tp)
    except BaseException:
        _reply(conn, RpcReply(spec.rank, error=traceback.format_exc()))
        raise SystemExit(1) from None
    _reply(conn, RpcReply(spec.rank))
    try:
        _serve(spec.rank, worker, conn)
    finally:
        destroy_distributed()


def _serve(rank: int, worker: Any, conn: Connection) -> None:
    while True:
        try:
            request: RpcRequest = conn.recv()
        except EOFError:  # the parent is gone
            return
        if request.method == _SHUTDOWN.method:
            return
        try:
            value = getattr(worker, request.method)(*request.args, **(request.kwargs or {}))
        except Exception:
            _reply(conn, RpcReply(rank, error=traceback.format_exc()))
            return
        if request.reply:
            _reply(conn, RpcReply(rank, value if rank == 0 else None))


def _reply(conn: Connection, reply: RpcReply) -> None:
    try:
        conn.send(reply)
    except OSError:
        os._exit(1)  # nobody to answer to


def ignore_sigterm_while_parent_lives(parent_pid: int) -> None:
    """SIGTERM to the whole process group (systemd's default KillMode, ``timeout``, ``kill -- -PGID``)
    reaches this child as well as the process that owns it: while that parent lives, it drains and
    then shuts its children down itself (killing them after a grace period), so the child leaves
    SIGTERM to it; an orphan still exits on it."""

    def on_sigterm(signum, frame):
        if os.getppid() != parent_pid:
            raise SystemExit(128 + signum)
        logger.info("SIGTERM left to the parent process (pid %d), which shuts this one down", parent_pid)

    signal.signal(signal.SIGTERM, on_sigterm)


def _watch_parent(parent_pid: int) -> None:
    """Exit when the parent is gone even while the main thread is stuck in a collective."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)
