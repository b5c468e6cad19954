"""Where start-up's memory profile finds its activation peak (the KV cache gets what is left):
a model of a benchmark shape with fewer layers (activations do not grow with depth), the
profile batch of ``ModelRunner._profile_free_memory``, and for each leaf module the memory
it allocates above what is live when it starts, largest peaks first; then the weights and
buffers that are not parameters, by size.

    python tests/gpu/memory_peak.py qwen3-30b-a3b --layers 2 [--tokens 16384]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from atom.benchmarks.model_configs import CONFIGS  # noqa: E402
from atom.engine.arg_utils import EngineArgs  # noqa: E402
from atom.worker.model_runner import ModelRunner  # noqa: E402

GIB = 1 << 30


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", choices=sorted(CONFIGS))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=16384, help="max_num_batched_tokens (the profile batch)")
    args = p.parse_args()
    path = tempfile.mkdtemp()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**CONFIGS[args.model], "num_hidden_layers": args.layers}, f)
    # the runner alone, before any KV cache, as at start-up
    runner = ModelRunner(EngineArgs(model=path, load_dummy=True, enforce_eager=True, skip_tokenizer_init=True,
                                    max_num_batched_tokens=args.tokens).create_engine_config())
    rows: list[tuple[float, float, str]] = []
    entry: dict[str, int] = {}

    def before(name):
        def hook(module, inputs):
            torch.cuda.synchronize()
            entry[name] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        return hook

    def after(name):
        def hook(module, inputs, output):
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            rows.append((peak / GIB, (peak - entry[name]) / GIB, name))
        return hook

    for name, m in runner.model.named_modules():
        if not list(m.children()):
            m.register_forward_pre_hook(before(name))
            m.register_forward_hook(after(name))
    start = torch.cuda.memory_allocated()
    budget = runner._profile_free_memory()
    print(f"allocated before the profile {start / GIB:.2f} GiB; KV budget {budget / GIB:.2f} GiB")
    print("| peak GiB | above entry GiB | module |\n|---|---|---|")
    for peak, extra, name in sorted(rows, reverse=True)[:20]:
        print(f"| {peak:.3f} | {extra:.3f} | {name} |")
    params = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    bufs = sorted(((b.numel() * b.element_size(), n) for n, b in runner.model.named_buffers()), reverse=True)
    print(f"parameters {params / GIB:.2f} GiB, buffers {sum(b for b, _ in bufs) / GIB:.2f} GiB; largest buffers:")
    for nbytes, name in bufs[:8]:
        print(f"  {nbytes / GIB:.3f} GiB  {name}")


if __name__ == "__main__":
    main()
