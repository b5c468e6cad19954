"""Tile sweep of the FP8 kernels on one GPU: each candidate config of the w8a8 GEMM (block
128x128 and per-channel), the FP8 fused MoE and the decode attention over an fp8 cache is
timed at Qwen3-8B / Qwen3-30B-A3B shapes, its output checked against the reference (max abs
difference; a candidate off by more than 2% of the output's magnitude cannot win), next to
bf16 (``torch.mm``, bf16 fused MoE, bf16 cache) and ``torch._scaled_mm`` rowwise.

Candidates are compiled first by a pool of worker processes (Triton's disk cache), then
timed one at a time by this process as the engine's CUDA graphs run them (``us``: no launch
overhead, L2 flushed before each call); past ``--budget`` seconds the rest is skipped.
Everything goes to $OUT/fp8_sweep.json (or ./gpu-results); the table printed last has, per
shape, the baselines, the current table's config and the best candidate.

    python tests/gpu/fp8_sweep.py [--budget 200] [--workers 12] [--only gemm|moe|attn]
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import time

import torch

FP8 = torch.float8_e4m3fn
DEV = "cuda"
TOL = 0.02
# (name, n, k): Qwen3-8B's four linear layers, Qwen3-30B-A3B's attention projections
GEMM_SHAPES = [("8b.qkv", 6144, 4096), ("8b.o", 4096, 4096), ("8b.gate_up", 24576, 4096), ("8b.down", 4096, 12288),
               ("30b.qkv", 5120, 2048), ("30b.o", 2048, 4096)]  # fmt: skip
GEMM_MS = [1, 16, 64, 256, 1024, 4096]
MOE_TOKENS = [1, 16, 64, 256, 1024, 2048, 4096]
MOE_SHAPE = dict(hidden=2048, inter=768, experts=128, top_k=8)  # Qwen3-30B-A3B
ATTN_CASES = [(1, 2048), (1, 8192), (8, 4096), (64, 2048)]


def _g(bm, bn, w, s, split=1, gm=8, bk=128):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, SPLIT_K=split, num_warps=w, num_stages=s)


def gemm_candidates(m: int, per_group: bool) -> list[dict]:
    if m <= 16:
        c = [_g(16, 32, 4, 4), _g(16, 64, 4, 4), _g(16, 128, 4, 3), _g(16, 32, 4, 4, 2), _g(16, 64, 4, 4, 2),
             _g(16, 32, 4, 4, 4), _g(16, 64, 4, 4, 4), _g(16, 64, 4, 5)]  # fmt: skip
    elif m <= 64:
        c = [_g(64, 32, 4, 4), _g(64, 64, 4, 4), _g(64, 128, 4, 3), _g(32, 64, 4, 4), _g(64, 32, 4, 4, 2),
             _g(64, 64, 4, 4, 2), _g(16, 64, 4, 4)]  # fmt: skip
    elif m <= 256:
        c = [_g(64, 64, 4, 4), _g(64, 128, 4, 3), _g(64, 128, 4, 4), _g(128, 128, 8, 3), _g(128, 64, 4, 4),
             _g(64, 256, 8, 3), _g(64, 64, 4, 4, 2)]  # fmt: skip
    else:
        c = [_g(64, 128, 4, 3), _g(64, 128, 4, 4), _g(128, 128, 8, 3), _g(128, 128, 8, 4), _g(128, 256, 8, 3),
             _g(64, 256, 8, 3), _g(128, 128, 4, 3), _g(128, 128, 8, 3, gm=16)]  # fmt: skip
    if not per_group:
        c += [_g(64, 128, 4, 3, bk=256)] if m > 64 else [_g(16, 64, 4, 3, bk=256)]
    return c


def _m(bm, bn, w, s, bk=128, down=None):
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
    return {**cfg, "down": down} if down else cfg


def moe_candidates(rows: float, per_group: bool) -> list[dict]:
    if rows <= 4:
        c = [_m(16, 16, 4, 4), _m(16, 32, 4, 4), _m(16, 64, 4, 4), _m(16, 128, 4, 4), _m(16, 64, 4, 3),
             _m(16, 32, 2, 5), _m(16, 64, 8, 4)]  # fmt: skip
    elif rows <= 32:
        c = [_m(16, 64, 4, 4), _m(16, 128, 4, 4), _m(32, 64, 4, 4), _m(32, 128, 4, 4), _m(64, 64, 4, 4),
             _m(64, 128, 4, 3)]  # fmt: skip
    else:
        c = [
            _m(64, 128, 4, 3),
            _m(64, 128, 4, 4),
            _m(64, 64, 4, 4),
            _m(128, 128, 8, 3),
            _m(128, 64, 4, 4),
            _m(128, 128, 8, 3, down=dict(BLOCK_N=256)),
            _m(64, 128, 4, 4, down=dict(BLOCK_N=256, num_warps=8)),
        ]
    if not per_group:
        c += [_m(16, 64, 4, 3, bk=256)] if rows <= 32 else [_m(64, 128, 4, 3, bk=256)]
    return c


# decode tiles of paged attention
_ATTN_TILES = [(64, 4, 2), (32, 4, 2), (128, 4, 2), (64, 4, 3), (64, 4, 1), (128, 8, 2), (64, 2, 2)]
ATTN_CANDIDATES = [dict(block_n=bn, num_warps=w, num_stages=s) for bn, w, s in _ATTN_TILES]
ATTN_SPLITS = [None, 16, 32, 128]


# --- the measured calls (shared by the compile workers and the timing loop) ---------------


@functools.cache
def gemm_weight(n: int, k: int, per_group: bool | None, kmajor: bool):
    """per_group None: the bf16 weight."""
    from atom.ops import reference_fp8

    gen = torch.Generator(DEV).manual_seed(10**6 + 31 * n + k)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=gen) * 0.02
    if per_group is None:
        return w
    q, s = reference_fp8.quantize_weight(w, 128, 128) if per_group else reference_fp8.quantize_weight(w)
    return q, s.t().contiguous().t() if kmajor else s


def gemm_inputs(n: int, k: int, m: int, per_group: bool, kmajor: bool):
    # (seeds apart from the weights': the first sweep drew x from the weight's stream for
    # m = n, so x @ w.T had a diagonal of squares)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=torch.Generator(DEV).manual_seed(7 * m + k))
    return x, *gemm_weight(n, k, per_group, kmajor)


def run_gemm(n: int, k: int, m: int, per_group: bool, kmajor: bool, cfg: dict | None):
    """The call to time (quantisation included), its inputs made beforehand."""
    from atom.ops.triton.fp8_gemm import per_token_group_quant_fp8, w8a8_matmul

    x, q, s = gemm_inputs(n, k, m, per_group, kmajor)
    g = 128 if per_group else 0

    def fn():
        a, a_s = per_token_group_quant_fp8(x, g, column_major=kmajor)
        return w8a8_matmul(a, a_s, q, s, g, torch.bfloat16, config=cfg)

    return fn


@functools.cache
def moe_weights(per_group: bool | None) -> tuple:
    """per_group None: the bf16 weights (w13, w2); else (w13, s13, w2, s2), scales K-major."""
    from atom.ops import reference_fp8

    p = MOE_SHAPE
    gen = torch.Generator(device=DEV).manual_seed(1)
    w13 = torch.randn(p["experts"], 2 * p["inter"], p["hidden"], device=DEV, dtype=torch.bfloat16, generator=gen)
    w2 = torch.randn(p["experts"], p["hidden"], p["inter"], device=DEV, dtype=torch.bfloat16, generator=gen)
    w13, w2 = w13 * 0.02, w2 * 0.03
    if per_group is None:
        return w13, w2
    g = 128 if per_group else 0
    out = []
    for w in (w13, w2):
        pairs = [reference_fp8.quantize_weight(w[e], g, g or 1) for e in range(w.shape[0])]
        q, s = torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs])
        out += [q, s.transpose(1, 2).contiguous().transpose(1, 2)]
    return tuple(out)


@functools.cache
def moe_tokens(tokens: int) -> tuple:
    from atom.ops import reference

    gen = torch.Generator(device=DEV).manual_seed(tokens)
    x = torch.randn(tokens, MOE_SHAPE["hidden"], device=DEV, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, MOE_SHAPE["experts"], device=DEV, generator=gen)
    return x, *reference.moe_topk(logits, MOE_SHAPE["top_k"], True)


def moe_inputs(per_group: bool | None, tokens: int) -> tuple:
    """fused_moe's (per_group None) or fused_moe_fp8's arguments, less group_k."""
    x, weights, ids = moe_tokens(tokens)
    return x, *moe_weights(per_group), weights, ids


def run_moe(per_group: bool, tokens: int, cfg: dict | None):
    from atom.ops.triton.moe_fp8 import fused_moe_fp8

    x, w13, s13, w2, s2, weights, ids = moe_inputs(per_group, tokens)
    return lambda: fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, 128 if per_group else 0, config=cfg)


@functools.cache
def attn_inputs(batch: int, ctx: int, fp8: bool):
    hq, hk, d, bs = 32, 8, 128, 16  # Qwen3-8B
    blocks = -(-(ctx + 1) // bs)
    gen = torch.Generator(device=DEV).manual_seed(batch + ctx)
    tables = torch.randperm(batch * blocks, device=DEV, generator=gen).to(torch.int32).view(batch, blocks)
    k = torch.randn(batch * blocks, hk, bs, d, device=DEV, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(k.shape, device=DEV, dtype=torch.bfloat16, generator=gen)
    if fp8:
        k, v = k.to(FP8), v.to(FP8)
    q = torch.randn(batch, hq, d, device=DEV, dtype=torch.bfloat16, generator=gen)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    lens = torch.full((batch,), ctx + 1, dtype=torch.int32, device=DEV)
    one = torch.ones(1, device=DEV)
    return q, k, v, cu, lens, tables, d**-0.5, one


def run_attn(batch: int, ctx: int, fp8: bool, cfg: dict | None, splits: int | None):
    from atom.ops.triton import attention

    q, k, v, cu, lens, tables, scale, one = attn_inputs(batch, ctx, fp8)
    scales = (one, one) if fp8 else (None, None)

    def fn():
        original = attention._config
        if cfg is not None:  # the candidate's decode tiles in place of the table's
            attention._config = lambda head_dim, group_pad, *_: dict(block_m=max(16, group_pad), **cfg)
        try:
            return attention.paged_attention(q, k, v, cu, lens, tables, scale, 1, ctx + 1, 0, None, None, *scales,
                                             num_splits=splits)  # fmt: skip
        finally:
            attention._config = original

    return fn


# --- the plan: every (kind, case, candidate) ----------------------------------------------


def plan() -> list[tuple]:
    """(kind, case, label, runner args), most wanted first (a budget cut skips the tail).
    Label "table" is the current table's choice."""
    from atom.ops.triton.fp8_configs import gemm_config, moe_config

    gemm = {True: [], False: []}
    for per_group in (True, False):
        mode = "block" if per_group else "channel"
        for name, n, k in GEMM_SHAPES:
            for m in GEMM_MS:
                case = (name, m, mode)
                table = gemm_config(m, n, k, per_group)  # explicit, so that it compiles in the pool
                gemm[per_group].append(("gemm", case, "table", (n, k, m, per_group, True, table)))
                if per_group:  # the row-major scale layouts (before this sweep) at the table's tiles
                    gemm[per_group].append(("gemm", case, "rowmajor", (n, k, m, per_group, False, table)))
                for cfg in gemm_candidates(m, per_group):
                    gemm[per_group].append(("gemm", case, json.dumps(cfg), (n, k, m, per_group, True, cfg)))
    moe = []
    for t in MOE_TOKENS:
        for per_group in (True, False):
            case = (t, "block" if per_group else "channel")
            rows = t * MOE_SHAPE["top_k"] / MOE_SHAPE["experts"]
            moe.append(("moe", case, "table", (per_group, t, moe_config(rows, per_group))))
            for cfg in moe_candidates(rows, per_group):
                moe.append(("moe", case, json.dumps(cfg), (per_group, t, cfg)))
    attn = []
    for batch, ctx in ATTN_CASES:
        for fp8 in (False, True):
            case = (batch, ctx, "fp8" if fp8 else "bf16")
            for splits in ATTN_SPLITS:
                attn.append(("attn", case, f"table/splits={splits}", (batch, ctx, fp8, None, splits)))
            if fp8 or batch == 1:
                for cfg in ATTN_CANDIDATES:
                    attn.append(("attn", case, json.dumps(cfg), (batch, ctx, fp8, cfg, None)))
    return gemm[True] + moe + attn + gemm[False]


def prepare(kind: str, args: tuple):
    """A call without arguments running one plan item (inputs made once, cached)."""
    if kind == "gemm":
        return run_gemm(*args)
    if kind == "moe":
        return run_moe(*args)
    if kind == "sort":  # the expert sort's kernels, specialised per pair count and row tile
        from atom.ops.triton.moe import _sort_by_expert

        ids = moe_inputs(None, args[0])[4]
        return lambda: _sort_by_expert(ids, MOE_SHAPE["experts"], args[1])[0]
    if kind == "moe_bf16":
        from atom.ops.triton import fused_moe

        inputs = moe_inputs(None, args[0])
        return lambda: fused_moe(*inputs)
    return run_attn(*args)


def compile_key(kind: str, args: tuple) -> tuple:
    """Calls with the same key compile the same kernels (Triton specialises integers on
    == 1 and divisibility by 16 only; all shapes here divide by 16)."""
    if kind == "gemm":
        n, k, m, per_group, kmajor, cfg = args
        return kind, m == 1, per_group, kmajor, json.dumps(cfg)
    if kind == "moe":
        per_group, t, cfg = args
        return kind, t == 1, per_group, json.dumps(cfg)
    if kind == "attn":
        return kind, args[0], args[2], json.dumps(args[3]), args[4]
    return kind, args


def warm(task: tuple) -> str:
    kind, args = task
    if kind == "gemm":  # a small shape of the same specialisation
        n, k, m, per_group, kmajor, cfg = args
        args = (2048, 4096, 1 if m == 1 else 64, per_group, kmajor, cfg)
    elif kind == "moe":
        args = (args[0], 1 if args[1] == 1 else 16, args[2])
    try:
        prepare(kind, args)()
        torch.cuda.synchronize()
        return "ok"
    except Exception as e:  # a config that does not compile (shared memory) loses only itself
        return f"{type(e).__name__}: {e}"[:200]


def compile_all(items: list[tuple], workers: int, seconds: float) -> None:
    tasks = {}
    for kind, _, _, args in items:
        tasks.setdefault(compile_key(kind, args), (kind, args))
    if any(it[0] == "moe" for it in items):
        block_ms = {c["BLOCK_M"] for r in (0.0, 1.0, 64.0) for g in (True, False) for c in moe_candidates(r, g)}
        for t in MOE_TOKENS:
            tasks[("moe_bf16", t)] = ("moe_bf16", (t,))
            for bm in sorted(block_ms | {16, 32, 64, 128}):
                tasks[("sort", t, bm)] = ("sort", (t, bm))
    print(f"compiling {len(tasks)} kernel variants on {workers} processes (at most {seconds:.0f} s)", flush=True)
    pool = mp.get_context("spawn").Pool(workers)
    result = pool.map_async(warm, list(tasks.values()), chunksize=1)
    result.wait(seconds)
    pool.terminate()  # compile stragglers (if any) happen on first use below
    pool.join()
    if result.ready():
        failed = [(task, r) for task, r in zip(tasks.values(), result.get()) if r != "ok"]
        print(f"{len(failed)} variants failed to compile or run:", *failed[:8], sep="\n  ", flush=True)
    else:
        print("compilation went past its share of the budget; the rest compiles on first use", flush=True)


# --- timing --------------------------------------------------------------------------------


def reference(kind: str, case: tuple, args: tuple) -> torch.Tensor:
    from atom.ops import reference as ref
    from atom.ops import reference_fp8

    if kind == "gemm":
        n, k, m, per_group, _, _ = args
        x, q, s = gemm_inputs(n, k, m, per_group, True)
        g = 128 if per_group else 0
        return reference_fp8.w8a8_matmul(*reference_fp8.per_token_group_quant_fp8(x, g), q, s, g, torch.float32)
    if kind == "moe":
        per_group, t, _ = args
        x, w13, s13, w2, s2, weights, ids = moe_inputs(per_group, t)
        return reference_fp8.fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, 128 if per_group else 0)
    batch, ctx, fp8, _, _ = args
    q, k, v, cu, lens, tables, scale, one = attn_inputs(batch, ctx, fp8)
    scales = (one, one) if fp8 else (None, None)
    return ref.paged_attention(q.float(), k, v, cu, lens, tables, scale, 1, ctx + 1, 0, None, None, *scales)


@functools.cache
def _flush_buffer() -> torch.Tensor:
    return torch.empty(96 << 20, dtype=torch.int8, device=DEV)  # larger than an H100's / H200's L2


def _graph(fn, reps: int, with_fn: bool) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            _flush_buffer().zero_()
            if with_fn:
                fn()
    return graph


def _replay_ms(graph: torch.cuda.CUDAGraph, times: int = 7) -> float:
    graph.replay()
    samples = []
    for _ in range(times):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return sorted(samples)[times // 2]


def us(fn) -> float:
    """GPU microseconds per call as the engine's CUDA graphs run it: calls captured in a
    graph (no launch overhead), each after an L2 flush (weights come from memory, as in a
    decode step), the flushes' own time subtracted. About 2 ms of calls per graph."""
    _flush_buffer()  # allocated outside any graph's memory pool
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    reps = max(2, min(10, int(2.0 / max(start.elapsed_time(end), 1e-3))))
    flushed, flush_only = _graph(fn, reps, True), _graph(fn, reps, False)
    t = (_replay_ms(flushed) - _replay_ms(flush_only)) / reps * 1000
    del flushed, flush_only
    return t


def baselines(kind: str, case: tuple) -> dict:
    if kind == "gemm":
        name, m, _ = case
        n, k = next((n, k) for nm, n, k in GEMM_SHAPES if nm == name)
        from atom.ops.triton.fp8_gemm import per_token_group_quant_fp8

        x, q, s = gemm_inputs(n, k, m, False, True)
        w = gemm_weight(n, k, None, True)

        def scaled_mm():
            a, a_s = per_token_group_quant_fp8(x, 0)
            return torch._scaled_mm(a, q.t(), scale_a=a_s, scale_b=s.t(), out_dtype=torch.bfloat16)

        return dict(bf16_us=us(lambda: torch.mm(x, w.t())), scaled_mm_us=us(scaled_mm),
                    quant_us=us(lambda: per_token_group_quant_fp8(x, 128)))  # fmt: skip
    if kind == "moe":
        from atom.ops.triton import fused_moe

        return dict(bf16_us=us(lambda: fused_moe(*moe_inputs(None, case[0]))))
    return {}


def measure(items: list[tuple], deadline: float) -> tuple[list[dict], dict]:
    rows, base, refs = [], {}, {}
    for kind, case, label, args in items:
        if time.monotonic() > deadline:
            rows.append(dict(kind=kind, case=case, label=label, skipped="budget"))
            continue
        key = (kind, case)
        try:
            if key not in refs:
                refs[key] = reference(kind, case, args).float()
                base[key] = baselines(kind, case)
            fn = prepare(kind, args)
            out = fn().float()
            err = (out - refs[key]).abs().max().item()
            ok = bool(err <= TOL * max(1.0, refs[key].abs().max().item())) and not out.isnan().any().item()
            rows.append(dict(kind=kind, case=case, label=label, us=us(fn), max_abs_diff=err,
                             ok=ok))  # fmt: skip
        except Exception as e:
            rows.append(dict(kind=kind, case=case, label=label, error=f"{type(e).__name__}: {e}"[:300]))
    return rows, base


def summarize(rows: list[dict], base: dict) -> list[str]:
    cells = {}
    for r in rows:
        cells.setdefault((r["kind"], tuple(r["case"])), []).append(r)
    lines = []
    for (kind, case), rs in cells.items():
        good = [r for r in rs if r.get("ok")]
        table = next((r for r in rs if r["label"] in ("table", "table/splits=None") and "us" in r), None)
        best = min(good, key=lambda r: r["us"]) if good else None
        b = base.get((kind, case), {})
        parts = [f"{kind} {' '.join(map(str, case))}"]
        parts += [f"{k}={v:.1f}" for k, v in b.items()]
        if table:
            parts.append(f"table_us={table['us']:.1f}")
        row_major = next((r for r in rs if r["label"] == "rowmajor" and "us" in r), None)
        if row_major:
            parts.append(f"rowmajor_us={row_major['us']:.1f}")
        if best:
            parts.append(f"best_us={best['us']:.1f} err={best['max_abs_diff']:.2g} best={best['label']}")
        bad = [r for r in rs if "us" in r and not r["ok"]]
        if bad:
            parts.append(f"NOT_OK={len(bad)}")
        lines.append("  ".join(parts))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=200, help="seconds for the whole sweep")
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument("--only", choices=["gemm", "moe", "attn"], help="one kernel family")
    args = parser.parse_args()
    start = time.monotonic()
    os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/atom-fp8-sweep-triton")
    items = [it for it in plan() if args.only in (None, it[0])]
    compile_all(items, args.workers, args.budget * 0.45)
    print(f"compiled in {time.monotonic() - start:.0f} s; timing {len(items)} runs", flush=True)
    rows, base = measure(items, start + args.budget)
    out = os.environ.get("OUT") or "gpu-results"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "fp8_sweep.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows,
                       baselines=[dict(kind=k, case=c, **v) for (k, c), v in base.items()]), f, indent=1)  # fmt: skip
    lines = summarize(rows, base)
    with open(os.path.join(out, "fp8_sweep.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    skipped = sum("skipped" in r for r in rows)
    errors = sum("error" in r for r in rows)
    print(f"device: {torch.cuda.get_device_name()}  runs: {len(rows)}  skipped: {skipped}  errors: {errors}  "
          f"{time.monotonic() - start:.0f} s")  # fmt: skip
    print("\n".join(lines))


if __name__ == "__main__":
    main()
