"""Tensor parallelism across processes: ``RankWorker`` runs in every rank around that
rank's ``ModelRunner``; ``ParallelRunner`` stands in the engine process for the
``ModelRunner`` it would otherwise hold, and calls every rank through the executor.

Each step's ``SchedulerOutput`` goes to every rank with its requests copied into
``RequestState`` snapshots (the engine's ``Sequence`` objects stay in the engine). All
ranks run the same steps on the same full logits (the LM head all-gathers) with the same
seeds, so they sample the same tokens; each rank keeps its own last sampled tokens for
the placeholders of async scheduling, and only rank 0's ``RunnerOutput`` comes back.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from atom.config import Config
from atom.core_types import RunnerOutput, SchedulerOutput
from atom.distributed.parallel_state import TPInfo, default_backend
from atom.sampling_params import SamplingParams
from atom.worker.executor import MultiprocExecutor
from atom.worker.model_runner import ModelRunner


@dataclass(frozen=True, slots=True)
class RequestState:
    """A ``ScheduledRequest`` as of one step, sent to the ranks."""

    request_id: str
    token_ids: list[int]
    block_table: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]  # min_tokens masks them


def snapshot(batch: SchedulerOutput) -> SchedulerOutput:
    """The batch with its requests copied: the engine's ``Sequence`` objects do not cross
    the process boundary. The whole token list goes each step (simple; a delta protocol
    like vLLM's ``CachedRequestState`` would send only the new tokens)."""
    reqs = [RequestState(r.request_id, list(r.token_ids), list(r.block_table), r.num_prompt_tokens,
                         r.sampling_params, r.eos_token_ids) for r in batch.requests]
    return dataclasses.replace(batch, requests=reqs)


class RankWorker:
    """The executor's worker in each rank: the rank's ``ModelRunner``, one call per step."""

    def __init__(self, config: Config, tp: TPInfo):
        self.runner = ModelRunner(config, tp)

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def warmup(self) -> None:
        self.runner.warmup()

    def capture_cudagraphs(self) -> None:
        self.runner.capture_cudagraphs()

    def execute_model(self, batch: SchedulerOutput) -> RunnerOutput:
        return self.runner.launch(batch).result()

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)

    def start_profile(self) -> None:
        self.runner.start_profile()

    def stop_profile(self) -> None:
        self.runner.stop_profile()


@dataclass(frozen=True, slots=True)
class DoneOutput:
    """A step that already finished (``collective_rpc`` waits): ``ModelRunner.launch``'s
    handle, for the engine."""

    output: RunnerOutput

    def result(self) -> RunnerOutput:
        return self.output


class ParallelRunner:
    """The engine's runner when ``tensor_parallel_size > 1``: the same methods as
    ``ModelRunner``, run on every rank. A rank that dies raises ``RankFailure`` (the
    executor has stopped all ranks by then)."""

    def __init__(self, config: Config):
        self.config = config
        pc = config.parallel_config
        self.executor = MultiprocExecutor(pc.tensor_parallel_size, functools.partial(RankWorker, config),
                                          backend=default_backend(config.device.type))
        self.profiler: bool | None = None  # not None while profiling, as ModelRunner's

    def determine_num_blocks(self) -> int:
        return self.executor.collective_rpc("determine_num_blocks")

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.executor.collective_rpc("allocate_kv_cache", num_blocks)

    def warmup(self) -> None:
        self.executor.collective_rpc("warmup")

    def capture_cudagraphs(self) -> None:
        self.executor.collective_rpc("capture_cudagraphs")

    def launch(self, batch: SchedulerOutput) -> DoneOutput:
        return DoneOutput(self.executor.collective_rpc("execute_model", snapshot(batch)))

    def release(self, request_id: str) -> None:
        self.executor.collective_rpc("release", request_id)

    # a method that raises in a rank stops every rank: user errors are caught here first
    def start_profile(self) -> None:
        if self.profiler is not None:
            raise RuntimeError("the profiler is already running")
        if self.config.torch_profiler_dir is None:
            raise RuntimeError("profiling needs --torch-profiler-dir or ATOM_TORCH_PROFILER_DIR")
        self.executor.collective_rpc("start_profile")
        self.profiler = True

    def stop_profile(self) -> None:
        if self.profiler is None:
            raise RuntimeError("the profiler is not running")
        self.executor.collective_rpc("stop_profile")
        self.profiler = None

    def shutdown(self) -> None:
        self.executor.shutdown()
