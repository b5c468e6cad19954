"""vLLM's GPU worker with one more warm-up step for atom's kernels.

vLLM's own warm-up runs its profile batch without attention, captures decode graphs and (its
model runner V2, vLLM 0.26's default) one prefill of 2-token prompts: atom's prefill-attention
tiles and the LM head's skinny GEMM (up to 32 rows) compiled inside the first requests, which
vLLM's JIT monitor logs as "Triton kernel JIT compilation during inference" (docs/performance.md,
sessions 13-14). Before vLLM's warm-up (so before its JIT monitor starts) this worker runs one
step of each batch kind atom's own engine warms up with (``atom.worker.warmup.warmup_batches``:
two long prompts, a mid-size one, a chunk after a cached prefix, decode rows beside a chunk,
decode rows at every split-K factor, a prompt of every power-of-two length) through vLLM's own
``execute_model``/``sample_tokens`` with hand-made scheduler outputs, as vLLM's
``run_mixed_prefill_decode_warmup`` does; then the LM head at every row bucket. The steps run
eager (the CUDA-graph dispatcher held at NONE): no graph is captured yet, and a step the
dispatcher sends to one tries to capture outside vLLM's capture phase and stops the warm-up (seen
with Qwen3-30B-A3B on an H200, where vLLM profiles its graphs' memory first).
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
from vllm.v1.worker.gpu_worker import Worker

from atom.worker.warmup import sampler_rows, warmup_batches

logger = logging.getLogger(__name__)

SKINNY_ROWS = 32  # the LM head's skinny GEMM serves up to this many rows (``gemv.skinny_gemm``)


class ATOMWorker(Worker):
    def compile_or_warm_up_model(self, *args, **kwargs):
        warm_up_atom_kernels(self)
        return super().compile_or_warm_up_model(*args, **kwargs)


def warm_up_atom_kernels(worker) -> bool:
    """The warm-up steps and the LM head at 1, 2, 4 .. 32 rows; False (logged) when this vLLM's
    worker differs from the one this was written against: the kernels then compile on first use."""
    start = time.perf_counter()
    try:
        sched = worker.scheduler_config
        # one token short of the model length: each step samples a token after its prompt
        batches = warmup_batches(sched.max_num_batched_tokens, worker.model_config.max_model_len - 1)
        runnable = [(i, q, s) for i, (q, s) in enumerate(batches) if len(q) <= sched.max_num_seqs]
        with eager_steps(worker.model_runner):
            steps = sum(run_step(worker, q_lens, seq_lens, f"_atom_warmup_{i}") for i, q_lens, seq_lens in runnable)
        with torch.inference_mode():
            model = worker.model_runner.get_model()
            hidden = torch.zeros(SKINNY_ROWS, worker.model_config.get_hidden_size(), dtype=worker.model_config.dtype,
                                 device=worker.device)  # fmt: skip
            for rows in sampler_rows(SKINNY_ROWS):
                model.compute_logits(hidden[:rows])
        torch.accelerator.synchronize()
    except Exception:
        logger.warning("atom kernel warm-up skipped (this vLLM's worker differs); kernels compile on first use",
                       exc_info=True)  # fmt: skip
        return False
    logger.info("atom kernel warm-up: %d steps of %d batch kinds and the LM head up to %d rows took %.1f s", steps,
                len(batches), SKINNY_ROWS, time.perf_counter() - start)  # fmt: skip
    return True


@contextlib.contextmanager
def eager_steps(model_runner):
    """The model runner's steps dispatched to no CUDA graph while inside (vLLM's V1 runner:
    ``CudagraphDispatcher.dispatch`` answers NONE while its mode is NONE); a runner without that
    dispatcher is left as it is."""
    dispatcher = getattr(model_runner, "cudagraph_dispatcher", None)
    if dispatcher is None or not hasattr(dispatcher, "cudagraph_mode"):
        yield
        return
    from vllm.config import CUDAGraphMode

    mode, dispatcher.cudagraph_mode = dispatcher.cudagraph_mode, CUDAGraphMode.NONE
    try:
        yield
    finally:
        dispatcher.cudagraph_mode = mode


def run_step(worker, q_lens: list[int], seq_lens: list[int], tag: str) -> bool:
    """One model step of new requests, request i scheduling ``q_lens[i]`` tokens after
    ``seq_lens[i] - q_lens[i]`` already computed (as a prefix-cache hit would: the blocks'
    contents do not matter, only the shapes), sampled, then finished. False when the KV cache
    has too few blocks for it."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    groups = worker.model_runner.kv_cache_config.kv_cache_groups
    block_sizes = [g.kv_cache_spec.block_size for g in groups]
    counts = [[-(-s // size) for s in seq_lens] for size in block_sizes]
    if sum(map(sum, counts)) >= worker.model_runner.kv_cache_config.num_blocks:
        return False
    next_block = iter(range(1, 1 << 31))  # block 0 is vLLM's null block
    step = SchedulerOutput.make_empty()
    for i, (q, s) in enumerate(zip(q_lens, seq_lens)):
        req_id, tokens = f"{tag}_{i}", [0] * s
        step.scheduled_new_reqs.append(NewRequestData(
            req_id=req_id, prompt_token_ids=tokens, mm_features=[],
            sampling_params=SamplingParams(max_tokens=1, temperature=0.0), pooling_params=None,
            block_ids=tuple([next(next_block) for _ in range(c[i])] for c in counts),
            num_computed_tokens=s - q, lora_request=None, prefill_token_ids=tokens))  # fmt: skip
        step.num_scheduled_tokens[req_id] = q
    step.total_num_scheduled_tokens = sum(q_lens)
    step.num_common_prefix_blocks = [0] * len(groups)
    finish = SchedulerOutput.make_empty()
    finish.finished_req_ids = set(step.num_scheduled_tokens)
    worker.execute_model(step)
    worker.sample_tokens(None)
    worker.execute_model(finish)
    return True
