"""vLLM's GPU worker with one more warm-up step for atom's kernels.

vLLM's own warm-up runs its profile batch without attention and captures decode graphs, so
atom's prefill-attention tiles and the LM head's skinny GEMM (up to 32 rows) were compiled
inside the first requests: on an H100 the throughput workload logged both as "Triton kernel JIT
compilation during inference" in its timed part (docs/performance.md, session 13). After vLLM's
warm-up this runs mixed batches (vLLM's dummy run: decode rows and one prompt) at a small and
at the full token budget, which select the prefill tiles for few and for many query tiles, and
the LM head at every row bucket, as atom's own engine does at start-up (``atom.worker.warmup``).
"""

from __future__ import annotations

import logging
import time

import torch
from vllm.v1.worker.gpu_worker import Worker

from atom.worker.warmup import sampler_rows

logger = logging.getLogger(__name__)

SKINNY_ROWS = 32  # the LM head's skinny GEMM serves up to this many rows (``gemv.skinny_gemm``)
SMALL_MIXED_BATCH = 256  # half decode rows, half one prompt: one or two query tiles per KV head


class ATOMWorker(Worker):
    def compile_or_warm_up_model(self, *args, **kwargs):
        result = super().compile_or_warm_up_model(*args, **kwargs)
        warm_up_atom_kernels(self.model_runner, self.scheduler_config.max_num_batched_tokens)
        return result


def warm_up_atom_kernels(runner, max_num_batched_tokens: int) -> None:
    """Mixed dummy batches through the model and the LM head at 1, 2, 4 .. 32 rows; a runner
    whose dummy run differs (another vLLM) is logged and skipped: the kernels then compile on
    first use, as before."""
    start = time.perf_counter()
    sizes = sorted({min(SMALL_MIXED_BATCH, max_num_batched_tokens), max_num_batched_tokens})
    try:
        with torch.inference_mode():
            for num_tokens in sizes:
                hidden, _ = runner._dummy_run(num_tokens, skip_eplb=True, is_profile=True, force_attention=True,
                                              create_mixed_batch=True)  # fmt: skip
            model = runner.get_model()
            for rows in sampler_rows(min(SKINNY_ROWS, hidden.shape[0])):
                model.compute_logits(hidden[:rows])
        torch.cuda.synchronize()
    except Exception:
        logger.warning("atom kernel warm-up skipped (this vLLM's dummy run differs); kernels compile on first use",
                       exc_info=True)  # fmt: skip
        return
    logger.info("atom kernel warm-up (mixed batches of %s tokens, LM head up to %d rows) took %.1f s", sizes,
                SKINNY_ROWS, time.perf_counter() - start)  # fmt: skip
