"""The API process's side of the engine core process: start it, send it requests over ZMQ,
read its outputs in an asyncio task.

The API process binds two IPC sockets in a private temporary directory: a PUSH socket that
carries requests, aborts and utility calls to the core, and a PULL socket that receives
outputs. Messages are the tagged msgspec Structs of ``atom.engine.outputs``; ZMQ keeps the
order of each socket, so an abort sent before a stats call is applied first.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from atom.config import Config
from atom.engine.engine_core_proc import IDLE_POLL_MS, run_engine_core
from atom.engine.outputs import (
    AbortRequests,
    AddError,
    CoreDead,
    CoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    FromCore,
    Shutdown,
    StatsUpdate,
    UtilityCall,
    UtilityReply,
)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 10.0


class EngineDeadError(RuntimeError):
    """The engine core process has died; no request can be served."""


class CoreClientBase:
    """What the server's core clients (one core, or ``-dp`` replicas) share: the callbacks
    ``on_outputs(outputs, stats)``, ``on_add_error(request_id, message)`` and ``on_dead(message)``,
    called from their reader tasks, and whether the engine is dead."""

    def __init__(
        self,
        config: Config,
        on_outputs: Callable[[list[EngineCoreOutput], EngineStats], None],
        on_add_error: Callable[[str, str], None],
        on_dead: Callable[[str], None],
    ):
        self.config = config
        self.on_outputs = on_outputs
        self.on_add_error = on_add_error
        self.on_dead = on_dead
        self.info: CoreInfo | None = None
        self.dead_reason: str | None = None

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None


class AsyncEngineCoreClient(CoreClientBase):
    """Starts the core process and talks to it from an asyncio event loop."""

    def __init__(self, *args) -> None:  # CoreClientBase's
        super().__init__(*args)
        self.stats: EngineStats | None = None  # the latest the core sent
        self.proc: mp.Process | None = None
        self._ipc_dir: str | None = None
        self._ctx = zmq.asyncio.Context()
        self._inp: zmq.asyncio.Socket | None = None
        self._out: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(FromCore).decode

    async def start(self) -> CoreInfo:
        """Spawn the core process, wait until its model is loaded, start reading outputs."""
        self._ipc_dir = tempfile.mkdtemp(prefix="atom-ipc-")
        # started from the event loop's thread: PR_SET_PDEATHSIG fires when the spawning
        # thread exits, and this thread lives as long as the server
        self.proc, self._inp, self._out, parent_conn = spawn_core(
            self.config, self._ctx, self._ipc_dir, "atom-engine-core"
        )
        self.info = await asyncio.get_running_loop().run_in_executor(None, wait_ready, self.proc, parent_conn)
        self._reader = asyncio.create_task(self._read_loop(), name="atom-engine-core-reader")
        return self.info

    @property
    def replica_stats(self) -> list[EngineStats | None]:
        """The latest stats of each replica, by index: here the one core's (``-dp`` lists N)."""
        return [self.stats]

    # requests (sends never block: the socket's queue is unbounded)
    def add_request(self, req: EngineCoreRequest) -> int:
        """Send a request; returns the index of the replica that runs it (0: there is one)."""
        self._send(req)
        return 0

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead:
            self._send(AbortRequests(list(request_ids)))

    async def call(self, method: str, *args, timeout: float = 60.0) -> Any:
        """Run a utility method in the core ('stats', 'start_profile', 'stop_profile')."""
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self._send(UtilityCall(call_id, method, list(args)))
            ok, result = await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)
        if not ok:
            raise RuntimeError(result)
        return result

    async def call_each(self, method: str, *args, timeout: float = 60.0) -> list[Any]:
        """``call`` on each replica, its results by replica index (here a list of one)."""
        return [await self.call(method, *args, timeout=timeout)]

    def _send(self, msg: EngineCoreRequest | AbortRequests | UtilityCall | Shutdown) -> None:
        if self.is_dead:
            raise EngineDeadError(f"the engine core process is dead: {self.dead_reason}")
        self._inp.send(self._encode(msg), copy=False)

    # outputs
    async def _read_loop(self) -> None:
        while True:
            if not await self._out.poll(IDLE_POLL_MS):
                if not self.proc.is_alive():
                    self._mark_dead(f"engine core process exited with code {self.proc.exitcode}")
                    return
                continue
            msg = self._decode(await self._out.recv())
            try:
                if self._dispatch(msg):
                    return
            except Exception:  # a bug in a callback must not stop the reader of every request
                logger.exception("error while handling engine core message %s", type(msg).__name__)

    def _dispatch(self, msg: FromCore) -> bool:
        """Handle one message from the core; True when the core is gone."""
        match msg:
            case EngineCoreOutputs(outputs, stats):
                self.stats = stats
                self.on_outputs(outputs, stats)
            case StatsUpdate(stats):
                self.stats = stats
            case AddError(request_id, message):
                self.on_add_error(request_id, message)
            case UtilityReply(call_id, ok, result):
                fut = self._calls.get(call_id)
                if fut is not None and not fut.done():
                    fut.set_result((ok, result))
            case CoreDead(message):
                self._mark_dead(f"engine core failed:\n{message}")
                return True
        return False

    def _mark_dead(self, reason: str) -> None:
        if self.is_dead:
            return
        logger.error("%s", reason)
        self.dead_reason = reason
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self.on_dead(reason)

    async def shutdown(self) -> None:
        """Ask the core to abort everything and exit; kill it if it does not."""
        if self._reader is not None:
            self._reader.cancel()
        if self.proc is not None and self.proc.is_alive():
            if not self.is_dead:
                self._inp.send(self._encode(Shutdown()))
            await asyncio.get_running_loop().run_in_executor(None, self._join_or_kill)
        self.dead_reason = self.dead_reason or "the engine was shut down"
        for sock in (self._inp, self._out):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def _join_or_kill(self) -> None:
        stop_core(self.proc, "engine core")


def spawn_core(config: Config, ctx: zmq.Context, ipc_dir: str, name: str) -> tuple:
    """Start an engine-core process (``run_engine_core``) behind two IPC sockets bound in ``ipc_dir``: a
    PUSH socket for requests, aborts and utility calls (a send never blocks: the core drains it every
    step) and a PULL socket for what it sends. Returns (process, PUSH, PULL, the start-up pipe that
    ``wait_ready`` reads)."""
    in_addr, out_addr = f"ipc://{ipc_dir}/{name}-in", f"ipc://{ipc_dir}/{name}-out"
    inp, out = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.SNDHWM, 0)
    inp.bind(in_addr)
    out.bind(out_addr)
    spawn = mp.get_context("spawn")
    parent_conn, child_conn = spawn.Pipe(duplex=False)
    # Not daemonic: a daemon may not start children, and with tensor parallelism the core starts
    # the ranks; it still dies with this process (PR_SET_PDEATHSIG, parent poll) and is joined
    # at shutdown (stop_core)
    proc = spawn.Process(
        target=run_engine_core,
        name=name,
        daemon=False,
        args=(config, in_addr, out_addr, child_conn, os.getpid(), logging.getLogger().level or logging.INFO),
    )
    proc.start()
    child_conn.close()
    return proc, inp, out, parent_conn


def stop_core(proc: mp.Process, what: str) -> None:
    """Join a core that was asked to shut down; terminate it after SHUTDOWN_TIMEOUT_S, kill it if
    that fails too."""
    proc.join(SHUTDOWN_TIMEOUT_S)
    if proc.is_alive():
        logger.warning("%s did not exit in %.0f s; terminating it", what, SHUTDOWN_TIMEOUT_S)
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()


def wait_ready(proc: mp.Process, conn) -> CoreInfo:
    """Wait for a spawned core's start-up report (``run_engine_core``'s ready pipe)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(f"engine core process exited during start-up (exit code {proc.exitcode})")
        if time.monotonic() > deadline:
            raise RuntimeError("engine core process did not start in time")
    try:
        status, payload = conn.recv()
    except EOFError:
        raise RuntimeError(f"engine core process exited during start-up (exit code {proc.exitcode})") from None
    conn.close()
    if status != "ready":
        raise RuntimeError(f"engine core failed to start:\n{payload}")
    return payload
