"""Where the time of the throughput workload goes: wall time of prefill-carrying steps vs
pure decode steps, and a torch-profiler kernel table over decode steps 300-340.

    PYTHONPATH=. python tests/gpu/profile_steps.py qwen3-0.6b
"""

import random
import sys
import time

import torch

from atom import LLMEngine, SamplingParams
from atom.benchmarks.benchmark_throughput import workload
from atom.benchmarks.model_configs import model_dir


def main(name: str) -> None:
    llm = LLMEngine(model_dir(name), load_dummy=True, skip_tokenizer_init=True, max_model_len=4096)
    random.seed(0)
    prompts, max_tokens = workload(256, 1024, 1024)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)
    llm.add_request(prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens])
    times = {"prefill": [0.0, 0], "decode": [0.0, 0]}
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
    step = 0
    while not llm.is_finished():
        sched = llm.core.scheduler
        kind = "prefill" if sched.waiting or any(s.num_tokens - s.num_computed_tokens > 1 for s in sched.running) \
            else "decode"
        if step == 300:
            prof.start()
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.step()
        torch.cuda.synchronize()
        times[kind][0] += time.perf_counter() - start
        times[kind][1] += 1
        if step == 340:
            prof.stop()
        step += 1
    for kind, (t, n) in times.items():
        print(f"{name}: {kind} steps {n}, {t:.2f} s ({1000 * t / max(n, 1):.2f} ms/step)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main(sys.argv[1])
