"""``LLMEngine``'s core under ``-dp N``: N engine-core processes behind ``EngineCore``'s methods.

Each replica is the server's engine-core process (``run_engine_core``) with its own pair of
IPC sockets; this client runs in the caller's thread, with no event loop. ``step()`` returns
whatever outputs the replicas have sent, waiting for the first when there are none (the
replicas step on their own, all at once). A replica that dies or fails stops every replica
and raises ``RankFailure``, as a tensor-parallel rank does.

One difference from the in-process core: a request a replica refuses (it can never fit)
comes back from ``step()`` as an output with ``finish_reason="error"``, not as a ValueError
from ``add_request`` (``LLMEngine`` checks prompts before they get here).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import shutil
import tempfile
import weakref
from dataclasses import dataclass

import msgspec
import zmq

from atom.config import Config
from atom.engine.core_client import spawn_core, stop_core, wait_ready
from atom.engine.dp_balancer import LoadBalancer, merge_info, merge_stats, replica_configs
from atom.engine.engine_core_proc import IDLE_POLL_MS
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
from atom.worker.executor import RankFailure

logger = logging.getLogger(__name__)


@dataclass
class _Replica:
    index: int
    proc: mp.Process
    inp: zmq.Socket  # PUSH: requests, aborts, utility calls
    out: zmq.Socket  # PULL: outputs, stats, replies
    info: CoreInfo | None = None
    stats: EngineStats | None = None  # the latest it sent


class DPEngineCoreClient:
    def __init__(self, config: Config):
        self.config = config
        self._ipc_dir = tempfile.mkdtemp(prefix="atom-dp-")
        self._ctx = zmq.Context()
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(FromCore).decode
        self.replicas: list[_Replica] = []
        conns = []
        for cfg in replica_configs(config):
            r = cfg.parallel_config.data_parallel_rank
            proc, inp, out, conn = spawn_core(cfg, self._ctx, self._ipc_dir, f"atom-engine-core-{r}")
            self.replicas.append(_Replica(r, proc, inp, out))
            conns.append(conn)
        self._finalizer = weakref.finalize(
            self, _stop_replicas, self.replicas, self._ctx, self._ipc_dir, self._encode(Shutdown())
        )
        try:
            for replica, conn in zip(self.replicas, conns):
                replica.info = wait_ready(replica.proc, conn)
        except RuntimeError as e:
            self._finalizer()
            raise RuntimeError(f"data-parallel replica {replica.index}: {e}") from None
        self._poller = zmq.Poller()
        for replica in self.replicas:
            self._poller.register(replica.out, zmq.POLLIN)
        self.balancer = LoadBalancer(len(self.replicas))
        self._call_ids = itertools.count()
        self._replies: dict[int, UtilityReply] = {}
        self._early: list[EngineCoreOutput] = []  # read while waiting for a utility reply
        logger.info("%d data-parallel replicas started: pids %s", len(self.replicas), self.pids)

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self.replicas]

    # EngineCore's methods
    def info(self) -> CoreInfo:
        return merge_info([r.info for r in self.replicas])

    def add_request(self, req: EngineCoreRequest) -> int:
        """Send a request to the balancer's choice; returns that replica's index."""
        usage = [r.stats.kv_cache_usage if r.stats else 0.0 for r in self.replicas]
        replica = self.balancer.assign(req.request_id, usage)
        self._send(self.replicas[replica], req)
        return replica

    def abort_requests(self, request_ids: list[str]) -> None:
        for r, ids in self.balancer.release(request_ids).items():
            self._send(self.replicas[r], AbortRequests(ids))

    def has_unfinished_requests(self) -> bool:
        return self.balancer.num_outstanding > 0 or bool(self._early)

    def step(self) -> list[EngineCoreOutput]:
        """The outputs the replicas have sent; waits for one message when there are none."""
        outputs, self._early = self._early, []
        if not outputs and self.balancer.num_outstanding:
            outputs = self._read(block=True)
        return outputs

    def stats(self) -> EngineStats:
        return merge_stats(self._call_all("stats"))

    def start_profile(self) -> None:
        self._call_all("start_profile")

    def stop_profile(self) -> None:
        self._call_all("stop_profile")

    def shutdown(self) -> None:
        """Stop every replica (also done at garbage collection and interpreter exit)."""
        self._finalizer()

    # transport
    def _send(self, replica: _Replica, msg) -> None:
        if not self._finalizer.alive:
            raise RankFailure("the data-parallel replicas are shut down")
        # a PUSH socket whose peer is gone (a dead replica) blocks a send forever: wait
        # until it can send, checking that every replica still lives
        while not replica.inp.poll(IDLE_POLL_MS, zmq.POLLOUT):
            self._check_alive()
        replica.inp.send(self._encode(msg), copy=False)

    def _call_all(self, method: str) -> list:
        ids = [next(self._call_ids) for _ in self.replicas]
        for replica, call_id in zip(self.replicas, ids):
            self._send(replica, UtilityCall(call_id, method))
        results = []
        for call_id in ids:
            while call_id not in self._replies:
                self._early += self._read(block=True)
            reply = self._replies.pop(call_id)
            if not reply.ok:
                raise RuntimeError(reply.result)
            results.append(reply.result)
        return results

    def _read(self, block: bool) -> list[EngineCoreOutput]:
        """Drain every replica that has messages; with ``block``, wait until one has."""
        if not self._finalizer.alive:
            raise RankFailure("the data-parallel replicas are shut down")
        ready = dict(self._poller.poll(0))
        while block and not ready:
            ready = dict(self._poller.poll(IDLE_POLL_MS))
            if not ready:
                self._check_alive()
        outputs = []
        for replica in self.replicas:
            while replica.out in ready:
                try:
                    msg = self._decode(replica.out.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                outputs += self._handle(replica, msg)
        return outputs

    def _handle(self, replica: _Replica, msg: FromCore) -> list[EngineCoreOutput]:
        match msg:
            case EngineCoreOutputs(outputs, stats):
                replica.stats = stats
                for out in outputs:
                    if out.finished:
                        self.balancer.finish(out.request_id)
                return outputs
            case StatsUpdate(stats):
                replica.stats = stats
            case AddError(request_id, message):
                self.balancer.finish(request_id)
                return [EngineCoreOutput(request_id, [], finish_reason="error", error=message)]
            case UtilityReply():
                self._replies[msg.call_id] = msg
            case CoreDead(message):
                self._fail(f"data-parallel replica {replica.index} failed:\n{message}")
        return []

    def _check_alive(self) -> None:
        for replica in self.replicas:
            if not replica.proc.is_alive():
                replica.proc.join()
                self._fail(
                    f"data-parallel replica {replica.index} (pid {replica.proc.pid}) died with exit code "
                    f"{replica.proc.exitcode}"
                )

    def _fail(self, message: str) -> None:
        logger.error("%s; stopping all %d replicas", message, len(self.replicas))
        self._finalizer()
        raise RankFailure(message)


def _stop_replicas(replicas: list[_Replica], ctx: zmq.Context, ipc_dir: str, shutdown_msg: bytes) -> None:
    """Ask each replica to finish (it stops its own ranks), then terminate what is left."""
    for r in replicas:
        if r.proc.is_alive():
            r.inp.send(shutdown_msg)
    for r in replicas:
        stop_core(r.proc, f"data-parallel replica {r.index}")
    for r in replicas:
        r.inp.close(linger=0)
        r.out.close(linger=0)
    ctx.term()
    shutil.rmtree(ipc_dir, ignore_errors=True)
