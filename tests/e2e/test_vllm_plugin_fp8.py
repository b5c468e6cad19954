"""FP8 through the vLLM plugin. The attention backend with ``--kv-cache-dtype fp8``: vLLM hands a
byte cache and the layer's ``_k_scale``/``_v_scale``; the backend writes e4m3 keys/values divided
by the scales and its attention equals the reference over the dequantised cache. And an FP8
(block-scaled) checkpoint with KV cache scales served by ``vllm.LLM`` through atom's layers with
an fp8 KV cache gives atom's ``LLMEngine`` tokens (the checkpoint's scales, not vLLM's 1.0). Runs
where vLLM and atom's entry points are installed (the plugin's environment)."""

import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from test_vllm_plugin import _env, needs_vllm

pytestmark = needs_vllm
PROMPTS = ["The quick brown fox", "def add(a, b):"]
# vLLM's FP8 methods take bf16/fp16 models only
OFFLINE = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams

    def main():
        llm = LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=256, max_num_seqs=4,
                  kv_cache_memory_bytes=1 << 26, gpu_memory_utilization=0.15, kv_cache_dtype="fp8")
        outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        print("RESULT" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))

    if __name__ == "__main__":
        main()
""")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_fp8_kv_cache_through_the_backend(kv_cache_dtype):
    from atom.ops import reference
    from atom.plugin.vllm.attention import ATOMAttentionImpl, ATOMAttentionMetadata, split_kv_cache

    heads, kv_heads, head_size, block_size, num_blocks = 4, 2, 32, 16, 8
    impl = ATOMAttentionImpl(heads, head_size, head_size**-0.5, kv_heads, kv_cache_dtype=kv_cache_dtype)
    layer = SimpleNamespace(_k_scale=torch.tensor(0.05), _v_scale=torch.tensor(0.02))
    # two requests: 5 tokens of prefill, and a decode row after 20 cached tokens (written first)
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.zeros(num_blocks, kv_heads, block_size, 2 * head_size, dtype=torch.uint8)
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    k_all, v_all = (torch.randn(26, kv_heads, head_size, generator=gen) for _ in range(2))
    history = torch.arange(20) + 2 * block_size  # request 1's cached tokens live in blocks 2 and 3
    impl.do_kv_cache_update(layer, k_all[:20], v_all[:20], kv_cache, history)
    slots = torch.cat([torch.arange(5), torch.tensor([2 * block_size + 20])])
    impl.do_kv_cache_update(layer, k_all[20:], v_all[20:], kv_cache, slots)
    k_cache, v_cache = split_kv_cache(kv_cache.view(torch.float8_e4m3fn), head_size)
    expected_k = reference.to_cache_dtype(k_all[20:25], torch.float8_e4m3fn, layer._k_scale)
    assert torch.equal(k_cache[0, :, :5].transpose(0, 1).view(torch.uint8), expected_k.view(torch.uint8))

    q = torch.randn(6, heads, head_size, generator=gen)
    meta = ATOMAttentionMetadata(num_actual_tokens=6, max_query_len=5, max_seq_len=21,
                                 query_start_loc=torch.tensor([0, 5, 6], dtype=torch.int32),
                                 seq_lens=torch.tensor([5, 21], dtype=torch.int32), block_table=block_table,
                                 slot_mapping=slots)
    out = impl.forward(layer, q, None, None, kv_cache, meta, torch.empty(6, heads, head_size))
    k_deq, v_deq = k_cache.float() * layer._k_scale, v_cache.float() * layer._v_scale
    ref = reference.paged_attention(q, k_deq, v_deq, meta.query_start_loc, meta.seq_lens, block_table,
                                    head_size**-0.5)
    assert torch.allclose(out.view(6, heads, head_size), ref, atol=1e-5)


def test_fp8_checkpoint_and_kv_cache_in_vllm(tmp_path):
    """The checkpoint's k_scale/v_scale (ModelOpt's names) go to atom's layers; vLLM's layers
    quantise with them, as ``LLMEngine`` does."""
    from atom import LLMEngine, SamplingParams
    from atom.testing.fp8_checkpoint import add_kv_scales, write
    from atom.testing.tiny_checkpoint import build

    path = write(build(str(tmp_path / "bf16"), "qwen3", head_dim=32), str(tmp_path / "fp8"), "block", block=32)
    scaled = add_kv_scales(path, str(tmp_path / "fp8-kv-scales"), {"k_proj.k_scale": 0.37, "v_proj.v_scale": 0.53})
    script = tmp_path / "offline.py"
    script.write_text(OFFLINE)
    out = subprocess.run([sys.executable, str(script), scaled, json.dumps(PROMPTS)], env=_env(), capture_output=True,
                         text=True, timeout=600)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert out.returncode == 0 and line, out.stdout[-3000:] + out.stderr[-3000:]
    log = out.stdout + out.stderr  # vLLM's log lines: atom's model and attention backend ran
    assert "atom model ATOMQwen3ForCausalLM" in log and "ATOMAttentionBackend" in log

    def engine_tokens(model):
        engine = LLMEngine(model, dtype="bfloat16", kv_cache_dtype="fp8", max_model_len=256)
        return [o["token_ids"] for o in engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12),
                                                        use_tqdm=False)]

    ours = json.loads(line[0][len("RESULT"):])
    assert ours == engine_tokens(scaled)
    # the scales are in use: with 1.0 (vLLM's default) the greedy tokens differ
    assert ours != engine_tokens(path)
