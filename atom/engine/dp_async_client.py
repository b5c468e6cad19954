"""The server's engine under ``-dp N``: N ``AsyncEngineCoreClient``s (one engine-core
process each, a full replica) behind that client's own interface, so ``AsyncLLM`` needs
no other change. New requests go to the replica with the fewest outstanding requests,
aborts to the replica that owns the request; stats and start-up info are merged (each
replica's stats stay readable apart, by index, for the per-engine metrics). A
replica that dies makes the whole engine dead (the server reports it as with a dead
tensor-parallel rank); shutdown stops every replica.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from atom.engine.core_client import AsyncEngineCoreClient, CoreClientBase, EngineDeadError
from atom.engine.dp_balancer import LoadBalancer, merge_info, merge_stats, replica_configs
from atom.engine.outputs import CoreInfo, EngineCoreOutput, EngineCoreRequest, EngineStats


class DPAsyncEngineCoreClient(CoreClientBase):
    def __init__(self, *args) -> None:  # CoreClientBase's
        super().__init__(*args)
        self.clients = [
            AsyncEngineCoreClient(
                cfg, self._replica_outputs, self._replica_add_error, functools.partial(self._replica_dead, r)
            )
            for r, cfg in enumerate(replica_configs(self.config))
        ]
        self.balancer = LoadBalancer(len(self.clients))

    @property
    def replica_stats(self) -> list[EngineStats | None]:
        """The latest stats each replica sent, by replica index (None for one that sent none yet)."""
        return [c.stats for c in self.clients]

    @property
    def stats(self) -> EngineStats | None:
        """The latest stats every replica sent, merged (None until each has sent some)."""
        latest = self.replica_stats
        return merge_stats(latest) if all(s is not None for s in latest) else None

    async def start(self) -> CoreInfo:
        """Start every replica at once; if one fails, stop them all and raise its error."""
        infos = await asyncio.gather(*(c.start() for c in self.clients), return_exceptions=True)
        failed = [(r, e) for r, e in enumerate(infos) if isinstance(e, BaseException)]
        if failed:
            await self.shutdown()
            r, error = failed[0]
            raise RuntimeError(f"data-parallel replica {r}: {error}") from error
        self.info = merge_info(infos)
        return self.info

    def add_request(self, req: EngineCoreRequest) -> int:
        """Send a request to the balancer's choice; returns that replica's index."""
        if self.is_dead:
            raise EngineDeadError(f"the engine is dead: {self.dead_reason}")
        usage = [c.stats.kv_cache_usage if c.stats else 0.0 for c in self.clients]
        replica = self.balancer.assign(req.request_id, usage)
        self.clients[replica].add_request(req)
        return replica

    def abort_requests(self, request_ids: list[str]) -> None:
        for r, ids in self.balancer.release(request_ids).items():
            self.clients[r].abort_requests(ids)

    async def call(self, method: str, *args, timeout: float = 60.0) -> Any:
        """A utility method on every replica ('stats' merged; otherwise replica 0's result)."""
        results = await self.call_each(method, *args, timeout=timeout)
        return merge_stats(results) if method == "stats" else results[0]

    async def call_each(self, method: str, *args, timeout: float = 60.0) -> list[Any]:
        """A utility method on every replica at once; their results by replica index."""
        return list(await asyncio.gather(*(c.call(method, *args, timeout=timeout) for c in self.clients)))

    async def shutdown(self) -> None:
        await asyncio.gather(*(c.shutdown() for c in self.clients))
        self.dead_reason = self.dead_reason or "the engine was shut down"

    # the replicas' reader tasks
    def _replica_outputs(self, outputs: list[EngineCoreOutput], stats: EngineStats) -> None:
        for out in outputs:
            if out.finished:
                self.balancer.finish(out.request_id)
        self.on_outputs(outputs, self.stats or stats)

    def _replica_add_error(self, request_id: str, message: str) -> None:
        self.balancer.finish(request_id)
        self.on_add_error(request_id, message)

    def _replica_dead(self, replica: int, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = f"data-parallel replica {replica}: {reason}"
            self.on_dead(self.dead_reason)
