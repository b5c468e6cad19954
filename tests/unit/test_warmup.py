"""The start-up warm-up batches: within the limits, one of each kind, and runnable by the model."""

import pytest
import torch

from atom import LLMEngine
from atom.worker.warmup import (
    BALANCE_ROWS,
    MAX_SPLITS,
    SAMPLER_ROWS,
    sampler_rows,
    warm_up_sampler,
    warmup_batches,
    warmup_inputs,
)


def test_batches_cover_each_kind_within_limits():
    batches = warmup_batches(max_num_batched_tokens=16384, max_model_len=4096)
    for q_lens, seq_lens in batches:
        assert sum(q_lens) <= 16384 and max(seq_lens) <= 4096
        assert all(0 < q <= s for q, s in zip(q_lens, seq_lens))
        decodes = [q == 1 for q in q_lens]
        assert decodes == sorted(decodes, reverse=True)  # decode rows first, as the scheduler places them
    assert any(len(q) == 2 and min(q) > 1 for q, _ in batches)  # full-budget prefill of two prompts
    assert any(1 in q and max(q) > 1 for q, _ in batches)  # mixed: decode rows and a chunk
    chunk_over_prefix = [s[0] - q[0] for q, s in batches if len(q) == 1 and q[0] > 1]
    assert max(chunk_over_prefix) > 0
    # one decode row at each split-K factor: a key range of 32 keys per split, up to MAX_SPLITS
    decode_lens = sorted(s[0] for q, s in batches if q == [1])
    assert decode_lens == [16] + [32 * (1 << i) for i in range(1, MAX_SPLITS.bit_length())]
    # a decode batch whose programs fill the GPU without splits, over keys that take the balance splits
    from atom.ops.triton.attention import BALANCE_SPLITS, SPLIT_MIN_KEYS

    balanced = [(q, s) for q, s in batches if len(q) == BALANCE_ROWS and set(q) == {1}]
    assert balanced and min(balanced[0][1]) >= BALANCE_SPLITS * SPLIT_MIN_KEYS
    assert not any(len(q) > 1 and set(q) == {1} for q, _ in warmup_batches(16384, SPLIT_MIN_KEYS))  # too short


def test_batches_respect_small_limits():
    for q_lens, seq_lens in warmup_batches(max_num_batched_tokens=48, max_model_len=128):
        assert sum(q_lens) <= 48 and max(seq_lens) <= 128


def test_every_batch_runs_through_the_model(tiny_model):
    engine = LLMEngine(tiny_model("qwen3"), max_model_len=1024, enforce_eager=True)
    runner = engine.core.runner
    hidden = None
    with torch.inference_mode():
        for q_lens, seq_lens in warmup_batches(512, 1024):  # 1,024 keys: the balance-split decode batch too
            ids, positions, meta = warmup_inputs(q_lens, seq_lens, runner.block_size, runner.device)
            assert positions.tolist() == [p for q, s in zip(q_lens, seq_lens) for p in range(s - q, s)]
            assert meta.num_decode_tokens == q_lens.count(1)
            hidden = runner.run_model(ids, positions, meta)
            assert hidden.shape[0] == sum(q_lens)  # the KV read is block 0's: values do not matter
        warm_up_sampler(runner.model.compute_logits, hidden, max_rows=4)


def test_sampler_warmup_meets_every_split_count_and_lm_head_row_bucket():
    import triton

    from atom.ops.triton.gemv import WIDE_MAX_ROWS
    from atom.ops.triton.sampling_fused import _splits

    assert {triton.next_power_of_2(m) for m in range(1, WIDE_MAX_ROWS + 1)} <= set(SAMPLER_ROWS)

    cpu = torch.device("cpu")
    for vocab in (151936, 32000, 4096):
        for max_rows in (1, 3, 11, 20, 100, 256, 512):
            every = {_splits(rows, vocab, cpu) for rows in range(1, max_rows + 1)}
            assert {_splits(rows, vocab, cpu) for rows in sampler_rows(max_rows)} == every


@pytest.mark.parametrize("experts, top_k", [(128, 8), (160, 6), (8, 2), (256, 8), (64, 6)])
def test_batches_meet_every_moe_and_fp8_tile_bucket(experts, top_k):
    """A tile config first met inside a step compiles there (0.5-2 s): every config the fused
    MoE (bf16 and FP8 tables) and the FP8 GEMMs can pick for a batch within the budget is
    picked for some warm-up batch (the decode graphs' captures add nothing needed here)."""
    from atom.ops.triton.fp8_configs import gemm_config, moe_config
    from atom.ops.triton.moe import _gemm_config

    budget = 16384

    def configs(tokens):
        rows = tokens * top_k / experts
        return [repr(_gemm_config(tokens * top_k, experts, torch.bfloat16))] + [
            repr(f(v, g)) for g in (True, False) for f, v in ((moe_config, rows), (gemm_config_m, tokens))
        ]

    def gemm_config_m(m, per_group):
        return gemm_config(m, 4096, 4096, per_group)

    warm = {c for q, _ in warmup_batches(budget, 40960) for c in configs(sum(q))}
    needed = {c for tokens in range(1, budget + 1) for c in configs(tokens)}
    assert needed <= warm


def test_late_compiles_are_logged_with_when_they_happened(caplog, monkeypatch):
    # the hook Triton calls before compiling a kernel variant: each one is logged (and still
    # compiled) with the phase it happened in, capture or serving
    import triton

    from atom.worker.warmup import log_late_compiles

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", None)
    fn = type("Kernel", (), {"name": "_k"})()
    with caplog.at_level("INFO", logger="atom.worker.warmup"):
        log_late_compiles("during the CUDA-graph capture")
        assert triton.knobs.runtime.jit_cache_hook(fn=fn, compile={"constants": {(3,): 1}}) is None
        log_late_compiles()
        triton.knobs.runtime.jit_cache_hook(fn=fn, compile={"constants": {}})
    assert [r.getMessage() for r in caplog.records] == [
        "Triton kernel _k built during the CUDA-graph capture, constants {(3,): 1}",
        "Triton kernel _k built after start-up (a warm-up gap), constants {}",
    ]
