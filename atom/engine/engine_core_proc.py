"""The engine core process: one ``EngineCore`` in a busy loop, driven over ZMQ.

It drains its input socket (requests, aborts, utility calls, shutdown), runs one step while
there is work, and sends the step's outputs with fresh stats; when idle it blocks on its
input. Messages are the tagged msgspec Structs of ``atom.engine.outputs`` (msgpack on the
wire). It never outlives the API process: the kernel kills it when its parent dies
(``PR_SET_PDEATHSIG``), it checks its parent while idle, and it ignores Ctrl-C so that the
API process can finish or abort in-flight requests and then shut it down in order.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing import util as mp_util
from typing import Any

import msgspec
import zmq

from atom.config import Config
from atom.distributed.dp_attention import Lockstep
from atom.distributed.parallel_state import select_replica_gpus
from atom.engine.engine_core import EngineCore
from atom.engine.outputs import (
    AbortRequests,
    AddError,
    CoreDead,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
    StatsUpdate,
    ToCore,
    UtilityCall,
    UtilityReply,
)
from atom.worker.executor import ignore_sigterm_while_parent_lives

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # how often an idle core checks that its parent is alive
LOCKSTEP_IDLE_POLL_MS = 2  # an idle data-parallel-attention replica meets the others this often


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def run_engine_core(config: Config, in_addr: str, out_addr: str, ready_conn, parent_pid: int,
                    log_level: int) -> None:
    """Entry point of the core process (spawned)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process coordinates shutdown
    ignore_sigterm_while_parent_lives(parent_pid)  # a group SIGTERM too: it drains requests first
    pc = config.parallel_config
    name = f"engine-core {pc.data_parallel_rank}" if pc.data_parallel_size > 1 else "engine-core"
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s")
    try:
        if pc.data_parallel_size > 1 and config.device.type == "cuda":
            select_replica_gpus(pc.tensor_parallel_size, pc.data_parallel_rank)
        core = EngineCore(config)
    except BaseException:
        ready_conn.send(("failed", traceback.format_exc()))
        return
    ctx = zmq.Context()
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)
    inp.connect(in_addr)
    out.connect(out_addr)
    ready_conn.send(("ready", core.info()))
    ready_conn.close()
    try:
        EngineCoreProc(core, inp, out, parent_pid).run()
    finally:
        core.shutdown()  # the rank processes (tensor parallelism) before this one exits
        inp.close(linger=0)
        out.close(linger=1000)
        ctx.term()
    # everything is flushed; skip the interpreter's teardown of torch and the model, which
    # takes seconds and would only delay the server's shutdown
    mp_util._exit_function()  # multiprocessing's own exit hook: releases named semaphores
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class EngineCoreProc:
    """The busy loop around one ``EngineCore``."""

    def __init__(self, core: EngineCore, inp: zmq.Socket, out: zmq.Socket, parent_pid: int):
        self.core = core
        self.inp = inp
        self.out = out
        self.parent_pid = parent_pid
        self.running = True
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(ToCore).decode
        self._handlers: dict[type, Callable[[Any], None]] = {
            EngineCoreRequest: self._add, AbortRequests: self._abort, UtilityCall: self._call, Shutdown: self._shutdown,
        }

    def run(self) -> None:
        try:
            if self.core.lockstep is None:
                self._run_alone()
            else:
                self._run_in_lockstep(self.core.lockstep)
        except SystemExit:
            logger.info("engine core: terminated by signal")
        except BaseException:
            logger.exception("engine core failed")
            self.out.send(self._encode(CoreDead(traceback.format_exc())))
            raise
        finally:
            self._stop_profiler()

    def _run_alone(self) -> None:
        while self.running:
            self._handle_inputs(block=not self.core.has_unfinished_requests())
            if self.running and self.core.has_unfinished_requests():
                self._send_outputs(self.core.step())

    def _run_in_lockstep(self, lockstep: Lockstep) -> None:
        """Data-parallel attention: each iteration every replica meets the others
        (``Lockstep.round``); when any has work, each runs exactly one forward, its own
        step's or a padding token's, so all enter every MoE layer's collectives together."""
        while True:
            self._handle_inputs(block=False)
            busy = self.running and self.core.has_unfinished_requests()
            any_busy, stopping = lockstep.round(busy, not self.running)
            if stopping:  # one replica leaving (shutdown, lost parent) takes all with it
                return
            if not any_busy:
                if not self.inp.poll(LOCKSTEP_IDLE_POLL_MS) and os.getppid() != self.parent_pid:
                    logger.warning("engine core: parent process is gone, exiting")
                    self.running = False
                continue
            if busy:
                self._send_outputs(self.core.step())
            if not busy or not self.core.ran_forward:  # a step can schedule nothing (e.g. grammars compiling)
                self.core.runner.dummy_forward()

    def _send_outputs(self, outputs: list) -> None:
        if outputs:
            self.out.send(self._encode(EngineCoreOutputs(outputs, self.core.stats())))

    def _handle_inputs(self, block: bool) -> None:
        if block:
            while not self.inp.poll(IDLE_POLL_MS):
                if os.getppid() != self.parent_pid:
                    logger.warning("engine core: parent process is gone, exiting")
                    self.running = False
                    return
        while self.running:
            try:
                msg = self._decode(self.inp.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            self._handlers[type(msg)](msg)

    def _add(self, req: EngineCoreRequest) -> None:
        try:
            self.core.add_request(req)
        except ValueError as e:
            self.out.send(self._encode(AddError(req.request_id, str(e))))

    def _abort(self, msg: AbortRequests) -> None:
        self.core.abort_requests(msg.request_ids)
        self.out.send(self._encode(StatsUpdate(self.core.stats())))

    def _shutdown(self, msg: Shutdown) -> None:
        self.core.abort_requests(list(self.core.requests))
        self.running = False

    def _call(self, msg: UtilityCall) -> None:
        handlers: dict[str, Callable[..., Any]] = {
            "stats": self.core.stats,
            "start_profile": self.core.start_profile,
            "stop_profile": self.core.stop_profile,
        }
        try:
            result, ok = handlers[msg.method](*msg.args), True
        except Exception as e:  # the caller gets the error; the engine keeps serving
            result, ok = f"{type(e).__name__}: {e}", False
        self.out.send(self._encode(UtilityReply(msg.call_id, ok, result)))

    def _stop_profiler(self) -> None:
        # flush a trace that is still being recorded rather than lose it
        if self.core.profiling:
            try:
                self.core.stop_profile()
            except Exception:
                logger.exception("engine core: could not stop the profiler")
