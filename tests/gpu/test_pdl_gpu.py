"""Programmatic dependent launch (``ATOM_TRITON_PDL=1``, atom/ops/triton/pdl.py) changes when
kernels start, never what they compute: a decode layer's chain of kernels at Qwen3-8B's shapes,
replayed from a CUDA graph, gives the same bits with and without it, and an engine gives the
same greedy tokens.

Run in its own pytest process (``pytest tests/gpu/test_pdl_gpu.py``); needs an sm_90+ GPU.
"""

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton", allow_module_level=True)
if torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("programmatic dependent launch needs sm_90+", allow_module_level=True)

from atom import LLMEngine, SamplingParams  # noqa: E402
from atom.ops.triton import paged_attention, qk_norm_rope_store, rms_norm, silu_and_mul  # noqa: E402
from atom.ops.triton import pdl as pdl_mod  # noqa: E402
from atom.ops.triton.gemv import linear  # noqa: E402
from atom.testing.tiny_checkpoint import build  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, BLOCK, CTX = 4096, 32, 8, 128, 12288, 16, 3000


@pytest.fixture
def pdl(monkeypatch):
    """``pdl(on)`` switches programmatic dependent launch for the kernels launched next."""

    def switch(on: bool) -> None:
        monkeypatch.setenv("ATOM_TRITON_PDL", "1" if on else "0")
        pdl_mod._enabled.cache_clear()
        assert pdl_mod.pdl_enabled(torch.device("cuda")) is on

    yield switch
    pdl_mod._enabled.cache_clear()


def _layer_inputs(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    blocks = CTX // BLOCK + 1
    w = dict(norm=rand(HIDDEN, scale=1.0), qkv=rand((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
             o=rand(HIDDEN, HEADS * HEAD_DIM), norm2=rand(HIDDEN, scale=1.0), gate_up=rand(2 * FFN, HIDDEN),
             down=rand(HIDDEN, FFN), q_norm=rand(HEAD_DIM, scale=1.0), k_norm=rand(HEAD_DIM, scale=1.0))  # fmt: skip
    pos = torch.arange(4096, device="cuda", dtype=torch.float32)[:, None]
    freqs = pos * 1e6 ** (-torch.arange(0, HEAD_DIM, 2, device="cuda") / HEAD_DIM)
    state = dict(
        cos_sin=torch.cat([freqs.cos(), freqs.sin()], dim=-1),
        k_cache=rand(blocks, KV_HEADS, BLOCK, HEAD_DIM, scale=1.0), v_cache=rand(blocks, KV_HEADS, BLOCK, HEAD_DIM),
        positions=torch.tensor([CTX - 1], device="cuda"), slots=torch.tensor([CTX - 1], device="cuda"),
        cu_q=torch.tensor([0, 1], device="cuda", dtype=torch.int32),
        seq_lens=torch.tensor([CTX], device="cuda", dtype=torch.int32),
        tables=torch.arange(blocks, device="cuda", dtype=torch.int32)[None], x=rand(1, HIDDEN, scale=1.0),
        residual=rand(1, HIDDEN, scale=1.0),
    )  # fmt: skip
    return w, state


def _layer(w, s):
    """One decode layer at batch 1, as atom's Qwen3 runs it (skinny GEMVs, split-K attention)."""
    h, res = rms_norm(s["x"], w["norm"], 1e-6, s["residual"])
    q, k, v = linear(h, w["qkv"]).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k = qk_norm_rope_store(q.view(1, HEADS, HEAD_DIM), k.view(1, KV_HEADS, HEAD_DIM), v.view(1, KV_HEADS, HEAD_DIM),
                              w["q_norm"], w["k_norm"], 1e-6, s["positions"], s["cos_sin"], s["k_cache"],
                              s["v_cache"], s["slots"])  # fmt: skip
    o = paged_attention(q, s["k_cache"], s["v_cache"], s["cu_q"], s["seq_lens"], s["tables"], HEAD_DIM**-0.5, 1, CTX)
    h, res = rms_norm(linear(o.view(1, -1), w["o"]), w["norm2"], 1e-6, res)
    return linear(silu_and_mul(linear(h, w["gate_up"])), w["down"]), res


def _graph_outputs(w, s, inputs):
    """The layer captured in a CUDA graph, replayed once per input row; the outputs, cloned."""
    _layer(w, s)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _layer(w, s)
    results = []
    for x in inputs:
        s["x"].copy_(x)
        graph.replay()
        results.append(tuple(t.clone() for t in out))
    torch.cuda.synchronize()
    return results


def test_decode_layer_same_bits_with_pdl(pdl):
    w, s = _layer_inputs()
    inputs = [torch.randn(1, HIDDEN, device="cuda").to(torch.bfloat16) for _ in range(8)]
    cache = s["k_cache"].clone(), s["v_cache"].clone()
    pdl(False)
    eager = []
    for x in inputs:
        s["x"].copy_(x)
        eager.append(_layer(w, s))
    off = _graph_outputs(w, s, inputs)
    s["k_cache"].copy_(cache[0])
    s["v_cache"].copy_(cache[1])
    pdl(True)
    on = _graph_outputs(w, s, inputs)
    for a, b, c in zip(eager, off, on):
        for x, y, z in zip(a, b, c):
            assert torch.equal(x, y) and torch.equal(y, z)
    assert any(not torch.equal(on[0][0], r[0]) for r in on[1:])  # the inputs reached the outputs


def test_engine_same_greedy_tokens_with_pdl(pdl, tmp_path):
    path = build(str(tmp_path / "qwen3"), "qwen3", head_dim=64, hidden_size=256, intermediate_size=512,
                 dtype=torch.bfloat16)  # fmt: skip
    prompts = ["The quick brown fox", "Once upon a time, a small model learned to count: one, two, three. " * 4,
               "机器学习 🙂", "def add(a, b):"]  # fmt: skip
    tokens = {}
    for on in (False, True):
        pdl(on)
        engine = LLMEngine(path, max_model_len=512, dtype="bfloat16", device="cuda", kv_cache_memory_bytes=1 << 28)
        params = SamplingParams(temperature=0, max_tokens=32)
        one = [engine.generate([p], params, use_tqdm=False)[0]["token_ids"] for p in prompts]  # batch 1
        tokens[on] = one, [o["token_ids"] for o in engine.generate(prompts, params, use_tqdm=False)]
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()
    assert tokens[True] == tokens[False]
