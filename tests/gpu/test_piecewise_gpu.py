"""Piecewise CUDA graphs on the GPU: an engine whose mixed batches replay the pieces between
attention ops gives the same greedy tokens as one that launches them eagerly (decode graphs
only), on tiny checkpoints in float32 (dense, MoE, MLA) with chunked prefill and prefix caching
making mixed batches of many sizes; and a bf16 model at a real shape agrees by the measure of
docs/performance.md.

Run in its own pytest process (``pytest tests/gpu/test_piecewise_gpu.py``).
"""

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton", allow_module_level=True)

from atom import LLMEngine, SamplingParams  # noqa: E402
from atom.testing.agreement import teacher_forced_agreement  # noqa: E402
from atom.testing.tiny_checkpoint import build  # noqa: E402

PROMPTS = ["The quick brown fox", "Once upon a time, a small model learned to count: one, two, three. " * 6,
           "Once upon a time, a small model learned to count: one, two, three. " * 3 + "Then it stopped.",
           "a b c d e f g h i j k l m n o p " * 9, "Hello"]  # fmt: skip


def _tokens(engine, prompts, n=24):
    return [o["token_ids"] for o in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=n),
                                                    use_tqdm=False)]  # fmt: skip


def _without_piecewise(engine, fn):
    """``fn()`` with the engine's mixed batches launched eagerly (its piecewise graphs set aside):
    the same engine and weights, so any difference is the graphs'."""
    runner = engine.core.runner
    piecewise, runner.piecewise = runner.piecewise, None
    try:
        return fn()
    finally:
        runner.piecewise = piecewise


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "deepseek_v3", "llama"])
def test_piecewise_engine_matches_eager_mixed_batches(arch, tmp_path):
    path = build(str(tmp_path / arch), arch)  # the tiny qwen3's head_dim is 24: padded tiles
    # a small token budget chunks the long prompts, so steps mix decodes with chunks of many sizes
    engine = LLMEngine(path, max_model_len=512, dtype="float32", device="cuda", max_num_batched_tokens=96,
                       max_num_seqs=8, kv_cache_memory_bytes=1 << 28)  # fmt: skip
    runner = engine.core.runner
    assert runner.piecewise is not None and runner.piecewise.sizes[-1] == 96
    [pieces] = runner.piecewise.compilations  # one compilation serves every size
    assert len(pieces) == engine.config.model_config.hf_config.num_hidden_layers + 1
    expected = _without_piecewise(engine, lambda: _tokens(engine, PROMPTS))
    assert _tokens(engine, PROMPTS) == expected
    assert _tokens(engine, PROMPTS[::-1]) == expected[::-1]
    assert not runner.piecewise.missed and len(runner.piecewise.graphs) == len(pieces) * len(runner.piecewise.sizes)


@pytest.mark.parametrize("method", ["mtp", "shared_weights"])
def test_piecewise_with_speculative_decoding(method, tmp_path):
    """MTP's verify steps (K + 1 query rows a sequence) and chunked prompts replay the pieces;
    the tokens equal the same engine's without them."""
    from atom.testing.tiny_checkpoint import add_mtp_layer

    path = add_mtp_layer(build(str(tmp_path / "llama-mtp"), "llama"))
    engine = LLMEngine(path, max_model_len=512, dtype="float32", device="cuda", max_num_batched_tokens=96,
                       max_num_seqs=8, kv_cache_memory_bytes=1 << 28, method=method,
                       num_speculative_tokens=2)  # fmt: skip
    runner = engine.core.runner
    assert runner.piecewise is not None
    expected = _without_piecewise(engine, lambda: _tokens(engine, PROMPTS))
    assert _tokens(engine, PROMPTS) == expected
    assert not runner.piecewise.missed


@pytest.mark.parametrize("args", [dict(cudagraph_mode="FULL_DECODE_ONLY"), dict(level=0)])
def test_decode_only_mode_and_eager_levels_capture_no_pieces(tmp_path, args):
    path = build(str(tmp_path / "llama"), "llama")
    engine = LLMEngine(path, max_model_len=256, dtype="float32", device="cuda", kv_cache_memory_bytes=1 << 28,
                       **args)  # fmt: skip
    assert engine.core.runner.piecewise is None and engine.core.runner.graph_runner is not None


def test_piecewise_bf16_real_shape_agrees():
    """Qwen3-0.6B's shape, random weights, bf16: piecewise graphs against eager launches of the
    same engine, teacher-forced (prompts of up to 1000 tokens in chunks of at most 512)."""
    from atom.benchmarks.model_configs import model_dir

    engine = LLMEngine(model_dir("qwen3-0.6b"), load_dummy=True, max_model_len=1024, max_num_batched_tokens=512,
                       skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 30)  # fmt: skip
    assert engine.core.runner.piecewise is not None
    prompts = [[(7 * i + j) % 30000 + 100 for j in range(n)] for i, n in enumerate([3, 200, 700, 45, 1000])]

    class Eager:  # the reference's side of teacher_forced_agreement: the same engine without the pieces
        def __getattr__(self, name):
            attr = getattr(engine, name)
            return (lambda *a, **k: _without_piecewise(engine, lambda: attr(*a, **k))) if callable(attr) else attr

    fraction, positions = teacher_forced_agreement(Eager(), engine, prompts, 16, min_margin=0.1)
    assert positions >= 40 and fraction >= 0.99
