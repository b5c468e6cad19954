"""Start-up warm-up batches: one of each kind the scheduler can produce, so that torch.compile
and every Triton kernel variant compile before the first request instead of inside it.

A kernel variant compiled on first use stalls that step by 0.4-2 s (seen in the step trace
of a serving run on an H100: mixed batches of a first server process took 1.2-2.0 s instead
of 0.05-0.4 s), and a throughput benchmark's first process ran at half the speed of a
later one. The kinds: a full-budget prefill (torch.compile's graph, large prefill tiles,
the largest MoE tiles), a mid-size prompt, a short chunk over a cached prefix (small
prefill tiles), a mixed batch (decode rows launched apart from the chunk), decode batches
outside the CUDA graphs at every split-K factor, a prompt of every power-of-two length (the
MoE and FP8 tile buckets), and the sampler without and with every filter on.
The batches write no KV (slot -1) and read block 0 for every page: only shapes matter.
"""

from __future__ import annotations

import logging

import torch

from atom.forward_context import AttentionMetadata
from atom.ops.triton.attention import BALANCE_SPLITS, SPLIT_MIN_KEYS
from atom.worker.sampler import SamplingTensors, sample

logger = logging.getLogger(__name__)

MAX_SPLITS = 64  # atom.ops.triton.attention._num_splits: at most 64 splits of at least 32 keys
# decode rows enough that no model's (sequence, KV head) programs take the fill splits on a GPU of up to 256 SMs
BALANCE_ROWS = 512
# the LM head and sampling at these row counts meet every row bucket of the skinny GEMM
# (``gemv.skinny_gemm``: BLOCK_M is the next power of two) and every split count of the
# samplers (``sampling_fused._splits`` halves with each doubling of the rows)
SAMPLER_ROWS = tuple(1 << i for i in range(9))


def warmup_batches(max_num_batched_tokens: int, max_model_len: int) -> list[tuple[list[int], list[int]]]:
    """(query lengths, sequence lengths) of each warm-up batch; decode rows (query length 1)
    first. Also one prompt of every power-of-two length: the fused MoE's tiles follow the rows
    per expert (tokens x top-k / experts) and the FP8 GEMMs' the rows, in buckets at least
    two-fold wide (``atom.ops.triton.moe._gemm_config``, ``fp8_configs``), so each bucket
    holds a power of two, whatever the model's experts and top-k."""
    big = min(max_model_len, max(2, max_num_batched_tokens // 2))
    mid = min(max_model_len, 1024, max_num_batched_tokens)
    chunk = min(64, max_num_batched_tokens)
    prefix = min(max_model_len - chunk, 1024)
    batches = [([big, big], [big, big]), ([mid], [mid]), ([chunk], [chunk + prefix])]
    ctx = min(max_model_len, 256)
    batches.append(([1, 1, 1, chunk], [ctx, ctx, ctx, chunk + prefix]))
    splits = 1
    while splits <= MAX_SPLITS and 32 * splits <= max_model_len:  # one decode row at each split-K factor
        batches.append(([1], [32 * splits if splits > 1 else 16]))
        splits *= 2
    balanced = BALANCE_SPLITS * SPLIT_MIN_KEYS
    if balanced <= max_model_len:
        # a decode batch too large for the fill splits, over keys long enough for the balance splits (their
        # 128-key variant at 8+ query heads a KV head was first built in Qwen3-30B-A3B's graph capture)
        rows = min(BALANCE_ROWS, max_num_batched_tokens)
        batches.append(([1] * rows, [balanced] * rows))
    sizes = {sum(q) for q, _ in batches}
    n = 1
    while n <= min(max_num_batched_tokens, max_model_len):
        batches += [([n], [n])] if n not in sizes else []
        n *= 2
    return [(q, s) for q, s in batches if sum(q) <= max_num_batched_tokens]


def warmup_inputs(q_lens: list[int], seq_lens: list[int], block_size: int, device: torch.device):
    """input ids, positions and attention metadata of one warm-up batch."""
    num_tokens = sum(q_lens)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(q_lens, seq_lens)]).to(device)
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros(len(q_lens), -(-max(seq_lens) // block_size), dtype=torch.int32, device=device),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(seq_lens),
        num_decode_tokens=sum(1 for q in q_lens if q == 1),
    )
    return torch.zeros(num_tokens, dtype=torch.int64, device=device), positions, meta


def sampler_rows(max_rows: int) -> list[int]:
    """SAMPLER_ROWS capped at ``max_rows`` (no larger batch runs), ``max_rows`` included: the
    split count falls with the rows, so the largest batch meets the smallest one."""
    return sorted({min(rows, max_rows) for rows in SAMPLER_ROWS})


def warm_up_sampler(compute_logits, hidden: torch.Tensor, max_rows: int) -> None:
    """The LM head, temperature-only, min-p and filtered sampling at 1, 2, 4 .. 256 rows (up to
    ``max_rows``: the scheduler's ``max_num_seqs``, which start-up's memory profile covers).
    The LM head runs outside the CUDA graphs, and its skinny GEMM (up to 32 rows of a
    vocabulary-wide weight) compiles a variant per power-of-two row bucket; the samplers split
    a few rows over slices (``sampling_fused._splits``: the slice count is a compile-time
    constant), and each split compiles on first use too."""
    for rows in sampler_rows(max_rows):
        logits = compute_logits(hidden[:1].expand(rows, -1).contiguous())
        device = logits.device
        temperatures = torch.full((rows,), 0.7, device=device)
        sample(logits, SamplingTensors(temperatures, None, None, None, [None] * rows, all_greedy=False))
        top_k = torch.full((rows,), 5, dtype=torch.int32, device=device)
        top_p, min_p = torch.full((rows,), 0.9, device=device), torch.full((rows,), 0.05, device=device)
        sample(logits, SamplingTensors(temperatures, None, None, min_p, [None] * rows, all_greedy=False))
        sample(logits, SamplingTensors(temperatures, top_k, top_p, min_p, [None] * rows, all_greedy=False))


def log_late_compiles(when: str = "after start-up (a warm-up gap)") -> None:
    """Log each Triton kernel variant compiled from now on, saying ``when``: after start-up it
    is a gap in the warm-up, which stalls the step that meets it by 0.1-1 s; during the CUDA
    graph capture it lengthens start-up (a capture of 4 graphs took as long as one of 20)."""
    import triton

    def hook(*, fn, compile, **_):
        logger.info("Triton kernel %s built %s, constants %s", fn.name, when, compile["constants"])
        return None  # compile it

    triton.knobs.runtime.jit_cache_hook = hook
