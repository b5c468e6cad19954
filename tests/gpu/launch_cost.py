"""Host time of one call of each part of the attention op and of a bare Triton launch
(docs/performance.md, session 12): Qwen3-0.6B's layer 0 (random weights), a 1024-token prompt
and a mixed batch (16 decode rows at 900 tokens + a 256-token chunk), 300 calls without a sync.
Prints a table and writes it as JSON to $OUT/launch_cost.json.

    OUT=/tmp/p python tests/gpu/launch_cost.py
"""

import json
import os
import time

import torch

from atom import LLMEngine, ops
from atom.benchmarks.model_configs import model_dir
from atom.forward_context import set_forward_context
from atom.worker.warmup import warmup_inputs

DEV = torch.device("cuda")


def host_us(fn, n: int = 300) -> float:
    """Microseconds of host time a call (the loop does not wait for the GPU)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return elapsed


@torch.inference_mode()
def attention_rows(runner, layer, label: str, q_lens: list[int], seq_lens: list[int]) -> list[tuple[str, float]]:
    ids, pos, meta = warmup_inputs(q_lens, seq_lens, runner.block_size, DEV)
    t, h, hk, d = ids.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
    q, k, v = (torch.randn(t, n * d, dtype=torch.bfloat16, device=DEV) for n in (h, hk, hk))
    out = torch.empty(t, h * d, dtype=torch.bfloat16, device=DEV)
    attn = next(m for m in runner.model.modules() if hasattr(m, "q_norm"))
    qw, kw, eps, cs = attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, attn.rotary_emb.cos_sin_cache
    q3, k3, v3, o3 = q.view(t, h, d), k.view(t, hk, d), v.view(t, hk, d), out.view(t, h, d)
    store = (q3, k3, v3, qw, kw, eps, pos, cs, layer.k_cache, layer.v_cache, meta.slot_mapping, layer.k_scale,
             layer.v_scale)  # fmt: skip
    paged = (q3, layer.k_cache, layer.v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, layer.scale,
             meta.max_seqlen_q, meta.max_seqlen_k, meta.num_decode_tokens)  # fmt: skip
    scales = (layer.k_scale, layer.v_scale)
    calls = {
        "unified_attention op": lambda: torch.ops.atom.unified_attention(q, k, v, out, pos, cs, qw, kw, eps,
                                                                         layer.prefix),  # fmt: skip
        "layer.run (no op wrapper)": lambda: layer.run(q, k, v, out, pos, cs, qw, kw, eps),
        "qk_norm_rope_store custom op": lambda: ops.qk_norm_rope_store(*store),
        "qk_norm_rope_store kernel": lambda: ops.unwrapped("qk_norm_rope_store", DEV)(*store),
        "paged_attention_into, packed k/v (descriptors)": lambda: ops.paged_attention_into(o3, *paged, k3, v3, *scales),
        "paged_attention_into, k/v from the cache": lambda: ops.paged_attention_into(o3, *paged, None, None, *scales),
        "paged_attention custom op": lambda: ops.paged_attention(*paged, k3, v3, *scales),
    }
    with set_forward_context(meta, pos, runner.attn_layer_map):
        return [(f"{label}: {name}", host_us(fn)) for name, fn in calls.items()]


@torch.inference_mode()
def main() -> None:
    llm = LLMEngine(model_dir("qwen3-0.6b"), load_dummy=True, skip_tokenizer_init=True, max_model_len=4096,
                    enforce_eager=True, level=0)  # fmt: skip
    runner = llm.core.runner
    layer = runner.attn_layers[0]
    rows = attention_rows(runner, layer, "prefill 1024", [1024], [1024])
    rows += attention_rows(runner, layer, "16 decodes + 256", [1] * 16 + [256], [900] * 16 + [256])
    x, w = torch.randn(64, 1024, dtype=torch.bfloat16, device=DEV), torch.ones(1024, dtype=torch.bfloat16, device=DEV)
    rows += [("rms_norm kernel (a bare Triton launch)", host_us(lambda: ops.unwrapped("rms_norm", DEV)(x, w, 1e-6))),
             ("rms_norm custom op", host_us(lambda: ops.rms_norm(x, w, 1e-6))),
             ("torch.empty", host_us(lambda: torch.empty(64, 1024, device=DEV))),
             ("torch add", host_us(lambda: x + x))]  # fmt: skip
    print("| call | host us |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")
    with open(os.path.join(os.environ.get("OUT", "."), "launch_cost.json"), "w") as f:
        json.dump(dict(rows), f, indent=1)


if __name__ == "__main__":
    main()
