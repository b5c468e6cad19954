"""Gluon Hopper MLA decode on the GPU: correctness, then time against atom's Triton kernel and vLLM's
MLA backends (when vLLM imports). One command:

    python tests/gpu/gluon_mla_check.py [--timeout 240] [--config '{"wg1_regs": 232}']
    python tests/gpu/gluon_mla_check.py --heads 16 --config '{"fp8": true}'   # fp8 cache, vs FlashMLA
    python tests/gpu/gluon_mla_check.py --heads 16 --times "1,8192 1,32768" --splits 64   # shapes, splits
    ncu --clock-control none -k regex:_mla_decode_gluon --launch-skip 2 --launch-count 1 \
        python tests/gpu/gluon_mla_check.py --once 64,4096 [--heads 16]   # four launches, nothing else

The work runs in a subprocess with a timeout, so a kernel that fails to compile, computes wrong
results or hangs is reported. Correctness: fresh random bf16 inputs (seed printed), ragged sequence
lengths around the 64-key tiles, pages of 8 to 128 rows, forced split counts; each output against
atom's float32 reference (``atom.ops.mla.mla_decode``) within 2e-2 x max(1, |ref|) and its difference
from atom's Triton kernel (``{"fp8": true}``: an fp8 cache, 16 and 32 heads only). Timing:
DeepSeek-V3's 128 heads (``--heads``), ``tests/gpu/kernel_bench.py``'s MLA inputs and method (CUDA graph
over input copies that defeat L2, median replay).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the repo's atom
sys.path.insert(0, HERE)  # kernel_bench

# (heads, sequence lengths, page, forced splits or None)
CHECKS = [
    (128, [1], 16, None), (128, [63], 16, None), (128, [64], 16, None), (128, [65], 16, None),
    (128, [1000], 16, None), (128, [4097], 16, None), (128, [1, 100, 1000, 3000], 16, None),
    (64, [70, 5, 200], 64, None), (128, [333, 9], 32, None), (128, [77, 130], 8, None), (128, [700], 128, None),
    (128, [1000, 3], 16, 1), (128, [1000, 3], 16, 4), (128, [1000, 3], 16, 32), (256, [129], 16, 2),
    (128, [2048] * 64, 16, None), (16, [1, 63, 65, 1000], 16, None), (16, [4000], 16, 8), (32, [70, 5, 200], 64, None),
    (16, [3000] * 140, 16, None), (16, [77, 130], 8, None), (16, [700], 128, None), (16, [1, 64, 129], 16, 32),
    (32, [1000, 3], 16, 4), (32, [2048] * 64, 16, None), (32, [4097], 16, None),
]  # fmt: skip
TIMES = [(1, 1024), (1, 8192), (8, 4096), (8, 8192), (32, 4096), (64, 1024), (64, 4096), (64, 8192), (128, 4096),
         (1, 32768), (8, 32768)]  # fmt: skip


def check(cfg: dict, seed: int) -> dict:
    import torch

    from atom.ops import mla as reference
    from atom.ops.triton.mla import mla_decode
    from atom.ops.triton.mla_gluon import available, mla_decode_gluon, supported

    assert available(), "Gluon Hopper path not available on this device / Triton"
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    fp8 = cfg.get("fp8", False)
    k_scale = torch.tensor([0.5], device="cuda") if fp8 else None
    for heads, lens, page, splits in CHECKS:
        if fp8 and heads not in (16, 32):  # the narrow kernel's head counts
            continue
        blocks = [-(-n // page) for n in lens]
        tables = torch.full((len(lens), max(blocks) + 3), -1, dtype=torch.int32, device="cuda")
        ids = torch.randperm(sum(blocks) + 5, generator=g, device="cuda").int()
        at = 0
        for i, b in enumerate(blocks):
            tables[i, :b] = ids[at : at + b]
            at += b
        cache = torch.randn(sum(blocks) + 5, page, 576, generator=g, device="cuda")
        cache = (cache / k_scale).to(torch.float8_e4m3fn) if fp8 else cache.bfloat16()
        q = torch.randn(len(lens), heads, 576, generator=g, device="cuda").bfloat16()
        seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        scale = 192**-0.5
        assert supported(q, cache, 512)
        got = mla_decode_gluon(q, cache, seq_lens, tables.clamp(min=0), scale, splits, cfg, k_scale)
        torch.cuda.synchronize()
        ref = reference.mla_decode(q.float(), cache, seq_lens, tables.clamp(min=0), scale, 512, k_scale)
        tri = mla_decode(q, cache, seq_lens, tables.clamp(min=0), scale, 512, k_scale)
        err = (got.float() - ref).abs().max().item() if not got.isnan().any() else float("nan")
        tol = 2e-2 * max(1.0, ref.abs().max().item())
        key = f"H={heads} lens={lens if len(lens) < 5 else f'{len(lens)}x{lens[0]}'} page={page} splits={splits}"
        out[key] = dict(err=err, ok=err <= tol, vs_triton=(got.float() - tri.float()).abs().max().item())
    return out


def timing(cfg: dict, heads: int, times=TIMES, splits: int | None = None) -> dict:
    import functools

    import kernel_bench as kb
    import torch

    from atom.ops.triton.mla import mla_decode
    from atom.ops.triton.mla_gluon import mla_decode_gluon

    res = {}
    fp8 = cfg.get("fp8", False)
    for b, ctx in times:

        def builder(b=b, ctx=ctx):
            x = kb.mla_inputs(b, ctx, heads, fp8)
            cache, tables = x.caches[16]
            args = (x.q, cache, x.seq_lens, tables, kb.MLA_SCALE)
            refs = {"triton": functools.partial(mla_decode, *args, 512, x.k_scale)}
            # what vLLM runs: FA3-MLA over a bf16 cache, FlashMLA (fp8 query, block-64 cache) over an fp8 one
            if fp8 and not isinstance(kb.vllm_mla()["FLASHMLA"], str):
                refs["flashmla"] = kb.flashmla_call(x)
            if not fp8 and not isinstance(kb.vllm_mla()["FLASH_ATTN_MLA"], str):
                refs["fa3_mla"] = kb.fa3_mla_call(x)
            fn = functools.partial(mla_decode_gluon, *args, splits, cfg, x.k_scale)
            nbytes = b * (ctx + 1) * 576 * cache.element_size()
            return fn, refs, nbytes, 2 * heads * (2 * 512 + 64) * b * (ctx + 1)

        fns, refs, nbytes, flops = kb.prepare(builder)
        row = dict(gluon=kb.graph_ms(fns), flops=flops, nbytes=nbytes)
        row |= {name: kb.graph_ms(calls) for name, calls in refs.items()}
        res[f"b={b} ctx={ctx // 1024}k"] = row
        del fns, refs
        torch.cuda.empty_cache()
    return res


def page_timing(cfg: dict) -> dict:
    """b=64 ctx=4k over caches of other page sizes (``cfg["pages"]``), and with ``cfg["variants"]``."""
    import functools

    import kernel_bench as kb

    from atom.ops.triton.mla_gluon import mla_decode_gluon

    res = {}
    x = kb.mla_inputs(64, 4096, 128, False)
    for page in cfg.get("pages", []):
        cache, tables = _repage(x.caches[16], page)
        for name, extra in {"base": {}, **cfg.get("variants", {})}.items():
            c = {**{k: v for k, v in cfg.items() if k not in ("pages", "variants")}, **extra}
            fn = functools.partial(mla_decode_gluon, x.q, cache, x.seq_lens, tables, kb.MLA_SCALE, None, c)
            res[f"page={page} {name}"] = kb.graph_ms([fn] * 4)
    return res


def _repage(cache_tables, page):
    """The same latent rows in a cache of ``page``-row pages: (cache, block tables)."""
    import kernel_bench as kb
    import torch

    cache, tables = cache_tables
    rows = torch.stack([cache[t.long()].reshape(-1, cache.shape[-1]) for t in tables])
    return kb.paged(rows, page)


def once(cfg: dict, shape: str, heads: int) -> None:
    """Four launches at ``batch,context`` (kernel_bench's inputs), for a profiler."""
    import kernel_bench as kb
    import torch

    from atom.ops.triton.mla_gluon import mla_decode_gluon

    batch, context = (int(v) for v in shape.split(","))
    x = kb.mla_inputs(batch, context, heads, cfg.get("fp8", False))
    cache, tables = x.caches[16]
    for _ in range(4):
        mla_decode_gluon(x.q, cache, x.seq_lens, tables, kb.MLA_SCALE, None, cfg, x.k_scale)
    torch.cuda.synchronize()


def worker(cfg: dict, seed: int, heads: int, times=TIMES, splits: int | None = None) -> dict:
    from atom.ops.triton import mla

    mla._gluon_decode = lambda device: False  # mla_decode: the Triton kernel, the "triton" columns
    res = dict(cfg=cfg, check=check({k: v for k, v in cfg.items() if k not in ("pages", "variants")}, seed))
    if cfg.get("pages"):
        res["pages"] = page_timing(cfg)
        return res
    if all(c["ok"] for c in res["check"].values()):
        res["ms"] = timing(cfg, heads, times, splits)
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--config", default="{}")
    p.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    p.add_argument("--timeout", type=int, default=240)
    p.add_argument("--heads", type=int, default=128, help="query heads of the timed shapes (V3: 128, V2-Lite: 16)")
    p.add_argument("--once", metavar="B,CTX", help="only launch the kernel four times at this shape (for ncu)")
    p.add_argument("--times", metavar="B,CTX ...", help="the timed shapes instead of the default eleven")
    p.add_argument("--splits", type=int, help="context splits of the timed calls (default: the kernel's choice)")
    args = p.parse_args()
    cfg = json.loads(args.config)
    if args.once:
        once(cfg, args.once, args.heads)
        return
    if args.worker:
        times = [tuple(int(v) for v in t.split(",")) for t in args.times.split()] if args.times else TIMES
        print("RESULT " + json.dumps(worker(cfg, args.seed, args.heads, times, args.splits)))
        return
    print(f"seed {args.seed}, config {cfg}")
    cmd = [sys.executable, __file__, "--worker", "--config", args.config, "--seed", str(args.seed), "--heads",
           str(args.heads)]  # fmt: skip
    cmd += ["--times", args.times] if args.times else []
    cmd += ["--splits", str(args.splits)] if args.splits else []
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        print(f"TIMEOUT after {args.timeout}s (hang?)\n{(e.stderr or b'')[-3000:]}")
        sys.exit(1)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        print(f"worker failed rc={proc.returncode}\n{proc.stderr[-6000:]}")
        sys.exit(1)
    res = json.loads(lines[-1][7:])
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gluon_mla.json"), "w") as f:
            json.dump(res, f, indent=1)
    for key, c in res["check"].items():
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {key:<50} err {c['err']:.4f} vs triton {c['vs_triton']:.4f}")
    head = f"{args.heads} heads"
    ref = "flashmla" if cfg.get("fp8") else "fa3_mla"
    ref_ms = ref.replace("_", "-") + " ms"
    cols = f"{'gluon ms':>9} {'TF/s':>6} {'GB/s':>6} {'triton ms':>10} {'x':>5} {ref_ms:>11} {'x':>5}"
    print(f"\n{head:<16} {cols}")
    for key, ms in res.get("pages", {}).items():
        print(f"{key:<30} {ms:9.4f} ms")
    for key, r in res.get("ms", {}).items():
        fa = f"{r[ref]:11.4f} {r[ref] / r['gluon']:5.2f}" if ref in r else ""
        tf, gbs = r["flops"] / r["gluon"] / 1e9, r["nbytes"] / r["gluon"] / 1e6  # the latent read
        tri = f"{r['triton']:10.4f} {r['triton'] / r['gluon']:5.2f}"
        print(f"{key:<16} {r['gluon']:9.4f} {tf:6.0f} {gbs:6.0f} {tri} {fa}")


if __name__ == "__main__":
    main()
