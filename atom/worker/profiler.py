"""torch.profiler traces as the serving guide's section 5 describes: gzip TensorBoard traces
under ``<torch_profiler_dir>/<rank_dir>/``; ``ATOM_PROFILER_MORE=1`` adds shapes, stacks and
memory."""

from __future__ import annotations

import os

import torch


def start_torch_profiler(root: str | None, rank_dir: str, device: torch.device) -> torch.profiler.profile:
    if root is None:
        raise RuntimeError("profiling needs --torch-profiler-dir or ATOM_TORCH_PROFILER_DIR")
    more = os.environ.get("ATOM_PROFILER_MORE", "0") == "1"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(
        activities=activities, record_shapes=more, with_stack=more, profile_memory=more,
        on_trace_ready=torch.profiler.tensorboard_trace_handler(os.path.join(root, rank_dir), use_gzip=True),
    )
    profiler.start()
    return profiler
