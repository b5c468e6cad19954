"""Medians of an ``ATOM_STEP_TRACE`` timeline, by batch size: the engine's (``PATH``) and, under
tensor parallelism, rank 0's (``PATH.rank0.jsonl``); then where the run's wall time went:
seconds between one step's launch and the next, summed by kind of step (with prefill tokens,
or decode-only by batch size).

    python tests/gpu/trace_summary.py PATH
"""

from __future__ import annotations

import json
import os
import statistics
import sys

BUCKETS = [(1, 1), (2, 16), (17, 128), (129, 1 << 20)]


def table(rows: list[dict], size_key, keys: list[str], title: str) -> None:
    print(f"\n{title}\n| rows | steps | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 2))
    for lo, hi in BUCKETS:
        sel = [r for r in rows if lo <= size_key(r) <= hi]
        if sel:
            meds = [statistics.median(r[k] for r in sel if k in r) if any(k in r for r in sel) else "" for k in keys]
            print(f"| {lo}-{hi} | {len(sel)} | " + " | ".join(f"{m:.3f}" if m != "" else "" for m in meds) + " |")


def wall_time(steps: list[dict]) -> None:
    """Seconds from each step's launch to the next one's, summed by kind of step."""
    steps = sorted(steps, key=lambda r: r["t"])
    kinds: dict[str, list[float]] = {}
    for a, b in zip(steps, steps[1:]):
        rows = a["decodes"] + a["prefills"]
        kind = "with prefill" if a["prefills"] else next(f"decode {lo}-{hi}" for lo, hi in BUCKETS if lo <= rows <= hi)
        kinds.setdefault(kind, []).append(b["t"] - a["t"])
    total = sum(map(sum, kinds.values()))
    print(f"\nwall time by kind of step (launch to next launch; {total:.2f} s in all)\n"
          "| kind | steps | s | % | ms per step |\n|---|---|---|---|---|")
    for kind, gaps in sorted(kinds.items()):
        s = sum(gaps)
        print(f"| {kind} | {len(gaps)} | {s:.3f} | {100 * s / total:.1f} | {1000 * s / len(gaps):.2f} |")


def main() -> None:
    path = sys.argv[1]
    steps = [r for r in map(json.loads, open(path)) if "arrive" not in r] if os.path.exists(path) else []
    table(steps, lambda r: r["decodes"] + r["prefills"], ["sched_ms", "launch_ms", "wait_ms", "collect_ms", "gpu_ms",
                                                          "gap_ms"], f"engine steps ({path})")
    rank = f"{path}.rank0.jsonl"
    if os.path.exists(rank):
        rows = list(map(json.loads, open(rank)))
        table(rows, lambda r: r["rows"], ["idle_before_launch_ms", "launch_ms", "idle_before_collect_ms", "wait_ms"],
              f"rank 0 ({rank})")
    if len(steps) > 1:
        wall_time(steps)


if __name__ == "__main__":
    main()
