"""Piecewise CUDA graphs (atom.worker.piecewise): what runs on the CPU. The graph split at the
attention ops computes what the model computes; attention over inputs padded to a captured
size gives the real tokens' rows unchanged; weak references share memory; the config and flags
of the CUDA-graph modes. The captures themselves run on the GPU (tests/gpu/test_piecewise_gpu.py)."""

import argparse
import gc
import json
import weakref

import pytest
import torch
from transformers import AutoConfig

from atom.config import CompilationConfig, Config, ModelConfig
from atom.engine.arg_utils import EngineArgs
from atom.forward_context import AttentionMetadata, set_forward_context
from atom.worker.model_runner import ModelRunner
from atom.worker.piecewise import PiecewiseGraphs, weak_ref


def _runner(path: str) -> ModelRunner:
    runner = ModelRunner(Config(ModelConfig(path, AutoConfig.from_pretrained(path), torch.float32, 256, path)))
    runner.allocate_kv_cache(16)
    return runner


def _mixed_batch(block_size: int, vocab: int):
    """Two decode rows (contexts of 5 and 9 tokens, cached) and a 7-token prompt chunk after 3
    cached tokens, on distinct blocks, as ``ModelRunner.prepare`` lays a batch out."""
    torch.manual_seed(0)
    q_lens, seq_lens = [1, 1, 7], [5, 9, 10]
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(q_lens, seq_lens)])
    slots = torch.cat([tables[i, p // block_size] * block_size + p % block_size
                       for i, p in enumerate(positions.split(q_lens))])  # fmt: skip
    meta = AttentionMetadata(
        slot_mapping=slots.long(), cu_seqlens_q=torch.tensor([0, 1, 2, 9], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables, max_seqlen_q=7,
        max_seqlen_k=10, num_decode_tokens=2,
    )  # fmt: skip
    return torch.randint(0, vocab, (9,)), positions, meta


def _caches(runner: ModelRunner) -> list[torch.Tensor]:
    """Every layer's cache: K and V, or MLA's latents."""
    names = ("k_cache", "v_cache", "kv_cache")
    return [c for layer in runner.attn_layers for c in (getattr(layer, n, None) for n in names) if c is not None]


def _fill_cache(runner: ModelRunner) -> None:
    torch.manual_seed(1)
    for cache in _caches(runner):
        cache.normal_()


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
@torch.inference_mode()
def test_split_graph_computes_the_model(tiny_model, arch):
    """Dynamo's graph cut at each attention op (one piece per gap: layers + 1) and run piece
    by piece gives the eager model's hidden states on a mixed batch."""
    runner = _runner(tiny_model(arch))
    _fill_cache(runner)
    ids, positions, meta = _mixed_batch(runner.block_size, runner.config.model_config.hf_config.vocab_size)
    piecewise = PiecewiseGraphs(runner.model.forward, [16, 32], torch.device("cpu"))
    with set_forward_context(meta, positions, runner.attn_layer_map):
        expected = runner.model(ids, positions)
        _fill_cache(runner)  # the eager run wrote the batch's KV: start again from the same cache
        got = piecewise.forward(ids, positions)
    [pieces] = piecewise.compilations
    assert len(pieces) == runner.config.model_config.hf_config.num_hidden_layers + 1
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
@torch.inference_mode()
def test_attention_reads_only_the_real_rows_of_padded_inputs(tiny_model, arch):
    """The model on inputs padded past the batch's tokens (as a captured size pads them) gives
    the real rows' hidden states of the unpadded batch: attention attends the metadata's
    tokens, writes only their KV, and each other op is row-wise."""
    runner = _runner(tiny_model(arch))
    _fill_cache(runner)
    ids, positions, meta = _mixed_batch(runner.block_size, runner.config.model_config.hf_config.vocab_size)
    with set_forward_context(meta, positions, runner.attn_layer_map):
        expected = runner.model(ids, positions)
    caches = [c.clone() for c in _caches(runner)]
    _fill_cache(runner)
    pad = 7
    padded_ids = torch.cat((ids, torch.randint(0, 100, (pad,))))
    padded_pos = torch.cat((positions, torch.arange(pad)))
    with set_forward_context(meta, padded_pos, runner.attn_layer_map):
        got = runner.model(padded_ids, padded_pos)
    assert got.shape[0] == ids.shape[0] + pad
    torch.testing.assert_close(got[: ids.shape[0]], expected)
    for before, after in zip(caches, _caches(runner), strict=True):
        torch.testing.assert_close(after, before)  # the padded rows wrote no KV


def test_compiled_pieces_do_not_keep_the_model_alive(tiny_model):
    """Each runner compiles the model into a cache of its own: more engines of one model class
    than Dynamo's recompile limit (8) each get their single compilation, and a dropped engine's
    model, runner and graphs are freed with it."""
    def compile_once():
        runner = _runner(tiny_model("llama"))
        ids, positions, meta = _mixed_batch(runner.block_size, runner.config.model_config.hf_config.vocab_size)
        piecewise = PiecewiseGraphs(runner.model.forward, [16], torch.device("cpu"))
        with torch.inference_mode(), set_forward_context(meta, positions, runner.attn_layer_map):
            piecewise.forward(ids, positions)
        assert len(piecewise.compilations) == 1
        return weakref.ref(runner.model), weakref.ref(piecewise)

    for _ in range(10):
        model, piecewise = compile_once()
        gc.collect()
        assert model() is None and piecewise() is None


def test_weak_ref_views_the_same_memory():
    x = torch.arange(12.0).view(3, 4)[1:]
    w = weak_ref((x, 3))
    assert w[1] == 3 and w[0].shape == x.shape and w[0].stride() == x.stride()
    assert w[0].data_ptr() == x.data_ptr()
    x[0, 0] = -1.0
    assert w[0][0, 0] == -1.0


def test_cudagraph_mode_config_and_flags():
    assert CompilationConfig().cudagraph_mode == "FULL_AND_PIECEWISE"
    with pytest.raises(ValueError, match="cudagraph_mode must be one of"):
        CompilationConfig(cudagraph_mode="PIECEWISE_ONLY")
    with pytest.raises(ValueError, match="piecewise_capture_sizes must be positive"):
        CompilationConfig(piecewise_capture_sizes=(0, 16))
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--cudagraph-mode", "FULL_DECODE_ONLY"]))
    assert args._compilation_section(torch.device("cpu")).cudagraph_mode == "FULL_DECODE_ONLY"
    # vLLM's --compilation-config overrides the flags of the same names
    flags = ["--compilation-config", json.dumps({"cudagraph_mode": "NONE", "piecewise_capture_sizes": [8, 64]})]
    cc = EngineArgs.from_cli_args(parser.parse_args(flags))._compilation_section(torch.device("cpu"))
    assert (cc.cudagraph_mode, cc.piecewise_capture_sizes) == ("NONE", (8, 64))
    bad = EngineArgs.from_cli_args(parser.parse_args(["--compilation-config", '{"full_cuda_graph": true}']))
    with pytest.raises(ValueError, match="compilation_config keys not supported"):
        bad._compilation_section(torch.device("cpu"))
