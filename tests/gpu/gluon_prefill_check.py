"""Gluon Hopper prefill attention on the GPU: correctness, then time against atom's Triton
kernel and FlashAttention 3 (when ``vllm.vllm_flash_attn`` imports). One command:

    python tests/gpu/gluon_prefill_check.py            # table on stdout, JSON to $OUT if set

Each Gluon config runs in its own subprocess with a timeout, so a config that fails to
compile, computes wrong results or hangs is reported and the sweep goes on. Qwen3-8B heads
(32 q / 8 kv, head_dim 128), bf16, fresh random inputs (seed printed), causal, fresh prompts and
chunks over a cached prefix (read from a paged cache of 16-row blocks, as ``paged_attention`` runs it).
Correctness: max abs error against a float32 reference within 2e-2 x max(1, |ref|) (the
bf16 tolerance of tests/gpu/test_kernels_gpu.py), and the difference to atom's kernel.
Timing: every call captured over enough input copies to defeat L2 in one CUDA graph,
median replay time per call (as tests/gpu/kernel_bench.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repo's atom

CONFIGS = {  # over DEFAULT_CONFIG of atom.ops.triton.prefill_attention_gluon
    "default": {},  # persistent (work items from a global counter), 3 stages of 128 keys, ping-pong
    "static": dict(dynamic=False),  # static round robin
    "dyn_qregs": dict(dynamic=True, q_regs=True),  # and Q in registers (the next Q loads during an item)
    "nosplit": dict(splits=1),  # no key-range splits for launches of few items
    "r240": dict(consumer_regs=240),  # the consumer warpgroups at 240 registers (the loader at 24)
    "s3_pp_nonpersist": dict(persistent=False),  # run 1's best
    "s2_pp": dict(stages=2, consumer_regs=240),
    "s3_nopp": dict(pingpong=False),
    "s2_nopp_nonpersist": dict(stages=2, pingpong=False, persistent=False, consumer_regs=240),
}
# name -> (chunk lengths, cached prefix lengths)
CHECK_SHAPES = {"q=1": ([1], [0]), "q=17": ([17], [0]), "q=512": ([512], [0]), "q=1000": ([1000], [0]),
                "q=2048": ([2048], [0]), "q=3001": ([3001], [0]), "q=8192": ([8192], [0]),
                "8x2048": ([2048] * 8, [0] * 8), "varlen": ([1, 17, 1000, 3001, 128, 129, 64], [0] * 7),
                "q=512 ctx=4096": ([512], [4096]), "q=1000 ctx=3001": ([1000], [3001]),
                "q=5 ctx=100": ([5], [100]), "prefix mix": ([130, 129, 300, 64, 2049], [8000, 70, 0, 127, 1]),
                # key ranges split over programs (few long items); the second: splits with no key tile
                "q=100 ctx=5000": ([100], [5000]), "split mix": ([64, 30], [3000, 20])}
TIME_SHAPES = {"q=512": ([512], [0]), "q=2048": ([2048], [0]), "q=8192": ([8192], [0]), "8x2048": ([2048] * 8, [0] * 8),
               "q=512 ctx=4k": ([512], [4096]), "4x512 ctx=4k": ([512] * 4, [4096] * 4),
               "q=2048 ctx=4k": ([2048], [4096]), "q=2048 ctx=6k": ([2048], [6144]),
               "q=128 ctx=8k": ([128], [8192]), "q=256 ctx=16k": ([256], [16384])}  # fmt: skip
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
LOG2E = 1.4426950408889634


def inputs(shape, seed):
    """q and the chunks' own k, v packed [tokens, heads, d]; cu_seqlens; and every key of each
    sequence (cached prefix, then chunk) in a paged cache (block size 16, blocks scattered)."""
    import torch

    q_lens, ctx_lens = shape
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    k_all, v_all = (torch.randn(sum(seq_lens), KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
                    for _ in range(2))  # fmt: skip
    cu_k = [0, *itertools.accumulate(seq_lens)]
    chunk = torch.cat([torch.arange(cu_k[i] + c, cu_k[i + 1]) for i, c in enumerate(ctx_lens)]).cuda()
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
    max_blocks = -(-max(seq_lens) // BLOCK)
    tables = torch.randperm(len(q_lens) * max_blocks, device="cuda", generator=g).int().view(len(q_lens), max_blocks)
    k_cache = torch.zeros(len(q_lens) * max_blocks, KV_HEADS, BLOCK, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    pos = torch.cat([torch.arange(m, device="cuda") for m in seq_lens])
    seq = torch.repeat_interleave(torch.arange(len(q_lens), device="cuda"), torch.tensor(seq_lens, device="cuda"))
    slots = tables[seq, pos // BLOCK].long()
    k_cache[slots, :, pos % BLOCK] = k_all
    v_cache[slots, :, pos % BLOCK] = v_all
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return dict(q=q, k=k_all[chunk], v=v_all[chunk], k_all=k_all, v_all=v_all, cu_k=cu_k, cu=cu, k_cache=k_cache,
                v_cache=v_cache, tables=tables, lens=lens, q_lens=q_lens, ctx_lens=ctx_lens)  # fmt: skip


def reference(d):
    """float32 causal attention per sequence over its prefix and chunk (GQA by repeating K/V heads)."""
    import torch

    out = torch.empty(d["q"].shape, dtype=torch.float32, device="cuda")
    group = HEADS // KV_HEADS
    for i, (a, b) in enumerate(itertools.pairwise(d["cu"].tolist())):
        q = d["q"][a:b].float().transpose(0, 1)
        k, v = (d[x][d["cu_k"][i] : d["cu_k"][i + 1]].float().repeat_interleave(group, dim=1).transpose(0, 1)
                for x in ("k_all", "v_all"))  # fmt: skip
        ctx = d["ctx_lens"][i]
        visible = torch.arange(k.shape[1], device="cuda")[None, :] <= ctx + torch.arange(b - a, device="cuda")[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=HEAD_DIM**-0.5)
        out[a:b] = o.transpose(0, 1)
    return out


def calls(d):
    """name -> zero-argument call returning the output, for each kernel available."""
    import torch

    from atom.ops.triton.prefill_attention import prefill_attention
    from atom.ops.triton.prefill_attention_gluon import prefill_attention_gluon

    m, m_k = max(d["q_lens"]), int(d["lens"].max())
    scale = HEAD_DIM**-0.5
    out, tri_out = torch.empty_like(d["q"]), torch.empty_like(d["q"])
    cache = (d["k_cache"], d["v_cache"], d["lens"], d["tables"])
    fns = {
        # atom's Triton prefill kernel with packed K/V (what paged_attention ran before the Gluon one)
        "triton": lambda: (
            prefill_attention(d["q"], tri_out, *cache[:2], d["cu"], d["lens"], d["tables"], scale * LOG2E, k=d["k"],
                              v=d["v"], max_seqlen_k=m_k),
            tri_out,
        )[1],  # fmt: skip
        # as paged_attention calls it: the prefix (if any) from the paged cache
        "gluon": lambda cfg=None: (
            prefill_attention_gluon(d["q"], d["k"], d["v"], out, d["cu"], scale * LOG2E, cfg, cache=cache,
                                    max_seqlen_q=m, max_seqlen_k=m_k),
            out,
        )[1],  # fmt: skip
    }
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func as fa3
    except ImportError:
        return fns
    k_fa, v_fa = (c.permute(0, 2, 1, 3).contiguous() for c in (d["k_cache"], d["v_cache"]))
    fa_out = torch.empty_like(d["q"])
    fns["fa3"] = lambda: fa3(d["q"], k_fa, v_fa, max_seqlen_q=m, cu_seqlens_q=d["cu"], max_seqlen_k=m_k,
                             seqused_k=d["lens"], softmax_scale=scale, causal=True, block_table=d["tables"],
                             out=fa_out, fa_version=3)  # fmt: skip
    return fns


def graph_ms(fns) -> float:
    """Median device time per call of ``fns`` (one per input copy) replayed from a CUDA graph."""
    import torch
    import triton

    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") / len(fns)


def timed(name, shape, seed, cfg=None) -> float:
    """Time kernel ``name`` over enough input copies (4x L2) to defeat the cache."""
    import functools

    import torch

    q_lens, ctx_lens = shape
    nbytes = (sum(q_lens) * HEADS * 2 + (sum(q_lens) + sum(ctx_lens)) * KV_HEADS * 2) * HEAD_DIM * 2
    copies = min(32, max(1, -(-4 * torch.cuda.get_device_properties(0).L2_cache_size // nbytes)))
    fns = []
    for i in range(copies):
        fn = calls(inputs(shape, seed + i))[name]
        fns.append(functools.partial(fn, cfg) if name == "gluon" else fn)
    return graph_ms(fns)


def flops(shape) -> int:
    return 4 * HEADS * HEAD_DIM * sum(n * c + n * (n + 1) // 2 for n, c in zip(*shape))


def worker(kind: str, cfg: dict | None, seed: int) -> dict:
    """``baseline``: time atom's Triton kernel and FA3; ``gluon``: check then time one config."""
    import torch

    from atom.ops.triton.prefill_attention_gluon import available, prefill_attention_gluon

    res = dict(kind=kind, cfg=cfg, check={}, ms={})
    if kind == "baseline":
        names = [n for n in ("triton", "fa3") if n in calls(inputs(([16], [0]), seed))]
        for name, shape in TIME_SHAPES.items():
            res["ms"][name] = {n: timed(n, shape, seed) for n in names}
        return res
    assert available(), "Gluon Hopper path not available on this device / Triton"
    for shape, lens in CHECK_SHAPES.items():
        d = inputs(lens, seed)
        fns = calls(d)
        out = fns["gluon"](cfg).float()
        torch.cuda.synchronize()
        ref = reference(d)
        err = (out - ref).abs().max().item() if not out.isnan().any() else float("nan")
        tol = 2e-2 * max(1.0, ref.abs().max().item())
        res["check"][shape] = dict(err=err, ok=err <= tol,
                                   vs_triton=(out - fns["triton"]().float()).abs().max().item())  # fmt: skip
    # metadata sliced past the first sequence (cu_seqlens not starting at 0), as after decode rows;
    # then the kernel without a cache (fresh sequences only)
    d = inputs(CHECK_SHAPES["prefix mix"], seed)
    a = int(d["cu"][1])
    out = torch.empty_like(d["q"][a:])
    cache = (d["k_cache"], d["v_cache"], d["lens"][1:], d["tables"][1:])
    prefill_attention_gluon(d["q"][a:], d["k"][a:], d["v"][a:], out, d["cu"][1:], HEAD_DIM**-0.5 * LOG2E, cfg,
                            cache=cache)  # fmt: skip
    ref = reference(d)[a:]
    err = (out.float() - ref).abs().max().item()
    res["check"]["sliced"] = dict(err=err, ok=err <= 2e-2 * max(1.0, ref.abs().max().item()), vs_triton=0.0)
    d = inputs(CHECK_SHAPES["varlen"], seed)
    out = torch.empty_like(d["q"])
    prefill_attention_gluon(d["q"], d["k"], d["v"], out, d["cu"], HEAD_DIM**-0.5 * LOG2E, cfg)
    ref = reference(d)
    err = (out.float() - ref).abs().max().item()
    res["check"]["no cache"] = dict(err=err, ok=err <= 2e-2 * max(1.0, ref.abs().max().item()), vs_triton=0.0)
    if all(c["ok"] for c in res["check"].values()):
        for name, shape in TIME_SHAPES.items():
            res["ms"][name] = {"gluon": timed("gluon", shape, seed, cfg)}
    return res


def run_worker(kind, cfg, seed, timeout) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--config", json.dumps(cfg), "--seed", str(seed)]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(kind=kind, cfg=cfg, error=f"timeout after {timeout}s (hang?)")
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[7:]), "wall_s": round(time.time() - t0, 1)}
    return dict(kind=kind, cfg=cfg, error=f"rc={p.returncode}: {(p.stdout + p.stderr)[-3000:]}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--config", default="null")
    ap.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(3), "little"))
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names from CONFIGS")
    ap.add_argument("--timeout", type=int, default=150)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, json.loads(args.config), args.seed)), flush=True)
        return 0
    print(f"seed {args.seed}", flush=True)
    results = {"baseline": run_worker("baseline", None, args.seed, args.timeout)}
    for name in args.configs.split(","):
        results[name] = r = run_worker("gluon", CONFIGS[name], args.seed, args.timeout)
        if "error" in r:
            print(f"{name}: ERROR {r['error']}", flush=True)
            continue
        bad = {s: c for s, c in r["check"].items() if not c["ok"]}
        worst = max(c["err"] for c in r["check"].values())
        vs_t = max(c["vs_triton"] for c in r["check"].values())
        print(f"{name}: correctness {'FAIL ' + json.dumps(bad) if bad else 'ok'} (max err {worst:.4f}, "
              f"vs triton {vs_t:.4f}, {r['wall_s']}s)", flush=True)  # fmt: skip
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gluon_prefill.json"), "w") as f:
            json.dump(results, f, indent=1)
    base = results["baseline"].get("ms", {})
    if "error" in results["baseline"]:
        print(f"baseline: ERROR {results['baseline']['error']}")
    print("\n| shape | kernel | ms | TFLOP/s | vs FA3 | vs triton |\n|---|---|---|---|---|---|")
    for shape, lens in TIME_SHAPES.items():
        rows = dict(base.get(shape, {}))
        rows.update({n: r["ms"][shape]["gluon"] for n, r in results.items()
                     if n != "baseline" and shape in r.get("ms", {})})  # fmt: skip
        fa3, tri = rows.get("fa3"), rows.get("triton")
        for n, ms in rows.items():
            vs = [f"{ref / ms:.2f}" if ref else "-" for ref in (fa3, tri)]
            print(f"| {shape} | {n} | {ms:.4f} | {flops(lens) / ms / 1e9:.0f} | {vs[0]} | {vs[1]} |")
    return 0 if all("error" not in r and all(c["ok"] for c in r.get("check", {}).values())
                    for r in results.values()) else 1  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
