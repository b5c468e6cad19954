"""Data parallelism (``-dp N``): what the in-process and the asyncio clients share.

N engine-core processes each own a full replica of the model (with its own tensor-parallel
ranks under ``-tp``). ``replica_configs`` gives each its ``data_parallel_rank`` (the core
process picks its GPUs from it, rank-major); ``LoadBalancer`` sends each new request to the
replica with the fewest outstanding requests and remembers the owner, so that an abort
reaches it; ``merge_stats`` and ``merge_info`` make the replicas look like one engine.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterable, Sequence

from atom.config import Config
from atom.engine.outputs import CoreInfo, EngineStats
from atom.spec_decode.stats import merge_spec_stats


def replica_configs(config: Config) -> list[Config]:
    """One config per replica; with data-parallel attention they also share a rendezvous."""
    pc = config.parallel_config
    if pc.enable_dp_attention:  # a fresh file store per launch (removed by the last replica to leave)
        pc = dataclasses.replace(pc, dp_init_method=f"file://{tempfile.mkdtemp(prefix='atom-dp-')}/store")
    return [dataclasses.replace(config, parallel_config=dataclasses.replace(pc, data_parallel_rank=r))
            for r in range(pc.data_parallel_size)]


class LoadBalancer:
    """Least outstanding requests first; ties go to the lower KV-cache usage the replicas
    last reported, then to the lower index (so a batch added at once alternates)."""

    def __init__(self, num_replicas: int):
        self.load = [0] * num_replicas  # outstanding requests per replica
        self.owner: dict[str, int] = {}

    @property
    def num_outstanding(self) -> int:
        return len(self.owner)

    def assign(self, request_id: str, kv_usage: Sequence[float]) -> int:
        if request_id in self.owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        replica = min(range(len(self.load)), key=lambda r: (self.load[r], kv_usage[r], r))
        self.owner[request_id] = replica
        self.load[replica] += 1
        return replica

    def finish(self, request_id: str) -> int | None:
        """Forget a finished (or aborted) request; its replica, or None if unknown."""
        replica = self.owner.pop(request_id, None)
        if replica is not None:
            self.load[replica] -= 1
        return replica

    def release(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """Forget requests about to be aborted, grouped by the replica that must abort them."""
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            replica = self.finish(rid)
            if replica is not None:
                by_replica.setdefault(replica, []).append(rid)
        return by_replica


def merge_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """The replicas' stats as one engine's: counts add up (speculative decoding's too), KV usage
    is over all blocks."""
    blocks = sum(s.num_blocks for s in stats)
    spec = [s.spec for s in stats if s.spec is not None]
    return EngineStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage * s.num_blocks for s in stats) / blocks if blocks else 0.0,
        num_free_blocks=sum(s.num_free_blocks for s in stats),
        num_blocks=blocks,
        num_preemptions=sum(s.num_preemptions for s in stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        spec=merge_spec_stats(spec) if spec else None,
    )


def merge_info(infos: Sequence[CoreInfo]) -> CoreInfo:
    """Totals add up; the longest sequence is the smallest replica's (a request runs on one)."""
    return CoreInfo(num_blocks=sum(i.num_blocks for i in infos), block_size=infos[0].block_size,
                    max_seq_len=min(i.max_seq_len for i in infos), kv_capacity=sum(i.kv_capacity for i in infos))
