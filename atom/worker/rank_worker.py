"""Tensor parallelism across processes: ``RankWorker`` runs in every rank around that
rank's ``ModelRunner``; ``ParallelRunner`` stands in the engine process for the
``ModelRunner`` it would otherwise hold, and calls every rank through the executor.

Each step's ``SchedulerOutput`` goes to every rank with its requests copied into
``RequestState`` snapshots (the engine's ``Sequence`` objects stay in the engine). All
ranks run the same steps on the same full logits (the LM head all-gathers) with the same
seeds, so they sample the same tokens; each rank keeps its own last sampled tokens for
the placeholders of async scheduling, and only rank 0's ``RunnerOutput`` comes back.

A step is posted (``launch_step``, no answer) and collected later (``collect_step``), so
under async scheduling the ranks queue step N+1's device work before they wait for step
N's tokens, as the one-process runner does.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import json
import os
import time
from dataclasses import dataclass

import msgspec
import torch

from atom.config import Config
from atom.core_types import RunnerOutput, SchedulerOutput
from atom.distributed.all_reduce import CustomAllReduce
from atom.distributed.parallel_state import TPInfo, default_backend
from atom.sampling_params import SamplingParams
from atom.worker.executor import MultiprocExecutor
from atom.worker.model_runner import ModelRunner, PendingOutput


class TokenWindow(msgspec.Struct, frozen=True, gc=False):
    """The tokens ``[start, start + len(tokens))`` of a request's token list of ``length``
    tokens, indexed as the whole list: a decode step sends the ranks two ids, not the
    history. Reading outside the window is a bug in the caller and raises ``IndexError``.
    A Struct, as ``RequestState``: 256 of them unpickle in a quarter of a plain class's time."""

    start: int
    tokens: list[int]
    length: int

    @classmethod
    def cut(cls, token_ids: list[int], start: int, stop: int) -> TokenWindow:
        return cls(start, token_ids[start:stop], len(token_ids))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int | slice):
        if isinstance(i, slice):
            lo, hi, step = i.indices(self.length)
            if lo < hi and (step != 1 or lo < self.start or hi > self.start + len(self.tokens)):
                raise IndexError(f"tokens {lo}:{hi} are outside the window {self.start}:+{len(self.tokens)}")
            return self.tokens[lo - self.start : hi - self.start] if lo < hi else []
        j = (i + self.length if i < 0 else i) - self.start
        if not 0 <= j < len(self.tokens):
            raise IndexError(f"token {i} is outside the window {self.start}:+{len(self.tokens)}")
        return self.tokens[j]


class RequestState(msgspec.Struct, frozen=True, gc=False):
    """A ``ScheduledRequest`` as of one step, sent to the ranks (a Struct: 256 of them
    unpickle in a fraction of a frozen dataclass's time, every step, in every rank)."""

    request_id: str
    token_ids: list[int] | TokenWindow
    block_table: list[int]
    num_prompt_tokens: int
    # None once the ranks hold them (sent with a request's first step, dropped at release)
    sampling_params: SamplingParams | None
    eos_token_ids: tuple[int, ...] | None  # min_tokens masks them


def snapshot(batch: SchedulerOutput, known: set[str] = frozenset()) -> SchedulerOutput:
    """The batch with its requests copied: the engine's ``Sequence`` objects do not cross
    the process boundary. A step reads the tokens it computes and the next one (a prompt
    logprob's target, a draft to verify); logits processing (penalties, bad words) reads
    the whole history, which then goes whole. The sampling parameters of the ``known``
    requests stay behind: the ranks have them."""
    reqs = []
    for r, start, n in zip(batch.requests, batch.starts, batch.num_new_tokens):
        whole = r.sampling_params.processes_logits
        tokens = list(r.token_ids) if whole else TokenWindow.cut(r.token_ids, start, start + n + 1)
        params, eos = (None, None) if r.request_id in known else (r.sampling_params, r.eos_token_ids)
        reqs.append(RequestState(r.request_id, tokens, list(r.block_table), r.num_prompt_tokens, params, eos))
    return dataclasses.replace(batch, requests=reqs)


class RankWorker:
    """The executor's worker in each rank: the rank's ``ModelRunner``, one call per step."""

    def __init__(self, config: Config, tp: TPInfo):
        if tp.size > 1 and config.device.type == "cuda" and not config.parallel_config.disable_custom_all_reduce:
            device = torch.device("cuda", torch.cuda.current_device())
            tp = dataclasses.replace(tp, custom_all_reduce=CustomAllReduce.create(tp.group, device))
        self.runner = ModelRunner(config, tp)
        self.in_flight: dict[int, PendingOutput] = {}  # launched steps by number
        self.params: dict[str, tuple[SamplingParams, tuple[int, ...]]] = {}  # by request, until released
        self.trace = RankTrace.from_env(tp.rank)

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def warmup(self) -> None:
        self.runner.warmup()

    def capture_cudagraphs(self) -> None:
        self.runner.capture_cudagraphs()
        # the last start-up call: the model's and graphs' objects move out of the collector's
        # reach, so a collection scans only what steps create (vLLM freezes its engine core)
        gc.collect()
        gc.freeze()

    def launch_step(self, step: int, batch: SchedulerOutput, released: list[str]) -> None:
        start = time.perf_counter()
        for request_id in released:
            self.runner.release(request_id)
            self.params.pop(request_id, None)
        self.in_flight[step] = self.runner.launch(dataclasses.replace(batch, requests=self._complete(batch.requests)))
        if self.trace:
            self.trace.launched(step, start, len(batch.requests))

    def _complete(self, requests: list[RequestState]) -> list[RequestState]:
        """Fill in the sampling parameters that earlier steps brought."""
        out = []
        for r in requests:
            if r.sampling_params is None:
                r = msgspec.structs.replace(r, sampling_params=self.params[r.request_id][0],
                                            eos_token_ids=self.params[r.request_id][1])
            else:
                self.params[r.request_id] = r.sampling_params, r.eos_token_ids
            out.append(r)
        return out

    def collect_step(self, step: int) -> RunnerOutput:
        start = time.perf_counter()
        output = self.in_flight.pop(step).result()
        if self.trace:
            self.trace.collected(step, start)
        return output

    def start_profile(self) -> None:
        self.runner.start_profile()

    def stop_profile(self) -> None:
        self.runner.stop_profile()


class RankTrace:
    """With ``ATOM_STEP_TRACE``, rank 0's side of each step in ``<path>.rank0.jsonl``: the
    host time of its launch, the wait for the device, and how long the rank sat idle
    waiting for the engine's message before each (idle ranks: the engine process is the
    bottleneck; long waits: the device is)."""

    def __init__(self, path: str):
        self.file, self.rows, self.idle_since = open(path, "a"), {}, time.perf_counter()

    @classmethod
    def from_env(cls, rank: int) -> RankTrace | None:
        path = os.environ.get("ATOM_STEP_TRACE")
        return cls(f"{path}.rank{rank}.jsonl") if path and rank == 0 else None

    def launched(self, step: int, start: float, rows: int) -> None:
        now = time.perf_counter()
        self.rows[step] = dict(step=step, rows=rows, idle_before_launch_ms=_ms(self.idle_since, start),
                               launch_ms=_ms(start, now))
        self.idle_since = now

    def collected(self, step: int, start: float) -> None:
        now = time.perf_counter()
        row = self.rows.pop(step) | dict(idle_before_collect_ms=_ms(self.idle_since, start), wait_ms=_ms(start, now))
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        self.idle_since = now


def _ms(a: float, b: float) -> float:
    return round((b - a) * 1e3, 3)


@dataclass(frozen=True, slots=True)
class RankStep:
    """A step posted to the ranks: ``ModelRunner.launch``'s handle, for the engine."""

    executor: MultiprocExecutor
    step: int

    def result(self) -> RunnerOutput:
        return self.executor.collective_rpc("collect_step", self.step)


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
        self._steps = itertools.count()
        self._released: list[str] = []  # finished requests, released with the next step
        self._known: set[str] = set()  # requests whose sampling parameters the ranks hold

    def determine_num_blocks(self) -> int:
        return self.executor.collective_rpc("determine_num_blocks")

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.executor.collective_rpc("allocate_kv_cache", num_blocks)

    def warmup(self) -> None:
        self.executor.collective_rpc("warmup")

    def capture_cudagraphs(self) -> None:
        self.executor.collective_rpc("capture_cudagraphs")

    def launch(self, batch: SchedulerOutput) -> RankStep:
        step, released, self._released = next(self._steps), self._released, []
        self.executor.post("launch_step", step, snapshot(batch, self._known), released)
        self._known.update(r.request_id for r in batch.requests)
        return RankStep(self.executor, step)

    def release(self, request_id: str) -> None:
        self._released.append(request_id)
        self._known.discard(request_id)

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
