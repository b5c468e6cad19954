"""An optional per-step timeline of the engine core, for finding where a step's time goes.

Set ``ATOM_STEP_TRACE=/path/trace.jsonl`` and every step appends one JSON line: when it
started (wall clock), the host time of scheduling, launching and collecting, how long the
host waited for the device, the device time of the step's work (CUDA events around its
launch) and the device's idle gap before it, and the batch (decode rows, prefill rows and
tokens, waiting and running counts). Request arrivals at the core are lines of their own
(``{"arrive": t}``). Off by default: the engine then pays one attribute test per step.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import torch

from atom.core_types import SchedulerOutput


@dataclass
class _Step:
    row: dict
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None


@dataclass
class StepTrace:
    path: str
    cuda: bool
    pending: list[_Step] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    last_end: torch.cuda.Event | None = None
    marks: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get("ATOM_STEP_TRACE")
        return cls(path, torch.cuda.is_available()) if path else None

    def arrive(self) -> None:
        self.lines.append(json.dumps({"arrive": time.time()}))

    def mark(self, name: str) -> None:
        """The host clock at a point of the step (``begin`` first)."""
        self.marks[name] = time.perf_counter()

    def device_begin(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def launched(self, batch: SchedulerOutput, start: torch.cuda.Event | None, waiting: int, running: int) -> None:
        """After a launch: the batch's shape and the device events around its work."""
        decodes = batch.num_decodes
        m = self.marks
        row = {
            "t": time.time(),
            "sched_ms": _ms(m["begin"], m["scheduled"]),
            "launch_ms": _ms(m["scheduled"], time.perf_counter()),
            "decodes": decodes,
            "prefills": len(batch.requests) - decodes,
            "prefill_tokens": sum(batch.num_new_tokens) - decodes,
            "waiting": waiting,
            "running": running,
        }
        end = None
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self.pending.append(_Step(row, start, end))

    def collected(self, wait_ms: float, collect_ms: float) -> None:
        """After the oldest uncollected step's results were read back."""
        for step in self.pending:
            if "wait_ms" not in step.row:
                step.row.update(wait_ms=round(wait_ms, 3), collect_ms=round(collect_ms, 3))
                break
        self._flush_done()

    def _flush_done(self) -> None:
        while self.pending and "wait_ms" in self.pending[0].row:
            step = self.pending[0]
            if step.end is not None:
                if not step.end.query():
                    break
                step.row["gpu_ms"] = round(step.start.elapsed_time(step.end), 3)
                if self.last_end is not None:
                    step.row["gap_ms"] = round(self.last_end.elapsed_time(step.start), 3)
                self.last_end = step.end
            self.lines.append(json.dumps(step.row))
            self.pending.pop(0)
        if len(self.lines) >= 256:
            self.flush()

    def flush(self) -> None:
        if self.lines:
            with open(self.path, "a") as f:
                f.write("\n".join(self.lines) + "\n")
            self.lines.clear()


def _ms(a: float, b: float) -> float:
    return round((b - a) * 1000, 3)
