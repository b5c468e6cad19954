"""The step-time model of MTP speculative decoding on one GPU, with random weights (which
cannot show a real acceptance rate): the Moonlight-16B-A3B shape (DeepSeek-V3 architecture)
plus one MTP layer (``num_nextn_predict_layers=1``), prompts of random token ids, greedy,
``ignore_eos``. For each batch size it measures the decode step of the plain engine (K = 0,
atom's defaults: CUDA graphs, async scheduling) and the verify step (target forward over
1 + K tokens per row, rejection sampling, K draft steps) of ``method="mtp"`` and of the
``shared_weights`` test mode for K = 1..3; then, with ``E(a, K) = (1 - a^(K+1)) / (1 - a)``
tokens per verify step (each draft accepted with probability ``a`` given the ones before it
were), the speedup ``E(a, K) * plain step / verify step`` implied at a = 0.6, 0.8, 0.9. The
shared-weights mode accepts every greedy draft (K + 1 tokens per step, measured): its
end-to-end tokens/s over the plain engine's is the measured 100%-acceptance point, for a
draft that costs K forwards of the whole target.

A step's time is the engine's own ``ATOM_STEP_TRACE`` timeline: the median time from one
step's launch to the next over the steps of the timed run whose every row decodes (prefill
steps, which hold more than batch x (K + 1) tokens, and the warm-up run are left out); the
trace's device time (``gpu_ms``) is reported beside it. Tokens per verify step come from the
engine's speculative statistics (``EngineStats.spec``) over the timed run. Each engine runs
in a process of its own (its GPU memory is freed when it exits).

    python tests/gpu/mtp_step_bench.py                  # H100: 7 engines, about 5-7 minutes
    python tests/gpu/mtp_step_bench.py --methods plain,mtp --batch-sizes 1,16
    python tests/gpu/mtp_step_bench.py --tiny           # CPU: a scaled-down model, tests the script

Results (table, ``mtp_step_bench.json``, each engine's log and trace) go to $OUT (or
./gpu-results).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from atom.benchmarks.model_configs import CONFIGS, scaled_down  # noqa: E402

ACCEPTANCE = (0.6, 0.8, 0.9)


def expected_tokens(a: float, k: int) -> float:
    """Tokens per verify step when each of the K drafts is accepted with probability ``a``
    given the ones before it were, plus the one token the step samples itself."""
    return (1 - a ** (k + 1)) / (1 - a)


def model_dir(out: str, tiny: bool) -> str:
    name = "moonlight-16b-a3b"
    config = scaled_down(name) if tiny else dict(CONFIGS[name])
    config["num_nextn_predict_layers"] = 1  # DeepSeek-V3's MTP layer (Moonlight ships none)
    path = os.path.join(out, f"{name}-mtp{'-tiny' if tiny else ''}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return path


def decode_steps(trace: str, t0: float, t1: float, batch: int, k: int) -> list[dict]:
    """The timed run's steps whose rows all decode (or verify), each with ``period_ms``: from
    its launch to the next step's launch."""
    rows = [r for r in map(json.loads, open(trace)) if "arrive" not in r and t0 <= r["t"] <= t1]
    rows.sort(key=lambda r: r["t"])
    steps = []
    for a, b in zip(rows, rows[1:]):
        new_tokens = a["decodes"] + a["prefill_tokens"]  # the trace counts verify rows' tokens as prefill
        if a["decodes"] + a["prefills"] == batch and new_tokens <= batch * (k + 1):
            steps.append(dict(a, period_ms=(b["t"] - a["t"]) * 1e3))
    return steps


def worker(args) -> None:
    """One engine (method, K): a warm-up then a timed run at each batch size; writes a JSON."""
    from atom import LLMEngine, SamplingParams

    batches = [int(b) for b in args.batch_sizes.split(",")]
    kwargs = dict(load_dummy=True, skip_tokenizer_init=True, max_num_seqs=max(batches),
                  max_model_len=args.input_len + args.output_len + 64)
    if args.method != "plain":
        kwargs.update(method=args.method, num_speculative_tokens=args.k)
    if args.level is not None:
        kwargs["level"] = args.level
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    if args.tiny:
        kwargs["kv_cache_memory_bytes"] = 1 << 26
    start = time.time()
    engine = LLMEngine(args.model_dir, **kwargs)
    startup_s = time.time() - start
    vocab = json.load(open(os.path.join(args.model_dir, "config.json")))["vocab_size"]
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len)
    runs = []
    for b in batches:
        prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(2 * b)]
        engine.generate(prompts[b:], SamplingParams(temperature=0, ignore_eos=True, max_tokens=16), use_tqdm=False)
        before = engine.core.stats().spec
        t0 = time.time()
        outs = engine.generate(prompts[:b], greedy, use_tqdm=False)
        t1 = time.time()
        after = engine.core.stats().spec
        run = dict(batch=b, t0=t0, t1=t1, output_tokens=sum(o["num_tokens_output"] for o in outs))
        if after is not None:
            rows = after.num_drafts - before.num_drafts  # verify rows (a row per request per step)
            run.update(verify_rows=rows, tokens_per_step=1 + (after.num_accepted_tokens - before.num_accepted_tokens)
                       / max(rows, 1))
        runs.append(run)
    engine.shutdown()  # writes the rest of the step trace
    for run in runs:
        steps = decode_steps(os.environ["ATOM_STEP_TRACE"], run["t0"], run["t1"], run["batch"], args.k)
        run.update(decode_steps=len(steps), e2e_tok_s=run["output_tokens"] / (run["t1"] - run["t0"]))
        if steps:
            run["step_ms"] = statistics.median(s["period_ms"] for s in steps)
            gpu = [s["gpu_ms"] for s in steps if "gpu_ms" in s]
            run["gpu_ms"] = statistics.median(gpu) if gpu else None
    result = dict(method=args.method, k=args.k, startup_s=round(startup_s, 1), runs=runs)
    with open(args.result, "w") as f:
        json.dump(result, f, indent=1)


def run_engine(method: str, k: int, path: str, out: str, args) -> dict:
    name = f"{method}-k{k}"
    trace, result = os.path.join(out, f"trace-{name}.jsonl"), os.path.join(out, f"{name}.json")
    for f in (trace, result):
        if os.path.exists(f):
            os.remove(f)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--method", method, "--k", str(k),
           "--model-dir", path, "--result", result, "--batch-sizes", args.batch_sizes,
           "--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    cmd += ["--tiny"] * args.tiny + ["--enforce-eager"] * args.enforce_eager
    cmd += ["--level", str(args.level)] if args.level is not None else []
    env = dict(os.environ, ATOM_STEP_TRACE=trace, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    start = time.time()
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        try:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = round(time.time() - start, 1)
    print(f"{name}: rc {rc}, {wall} s", flush=True)
    return json.load(open(result)) | dict(wall_s=wall) if rc == 0 else dict(method=method, k=k, rc=rc, wall_s=wall)


def table(results: list[dict], batches: list[int]) -> list[dict]:
    """One row per batch size and K: the MTP verify step against the plain step, the speedup
    it implies at each acceptance rate, and the shared-weights mode's measured speedup."""
    by = {(r["method"], r["k"]): {run["batch"]: run for run in r.get("runs", [])} for r in results}
    plain = by.get(("plain", 0), {})
    rows = []
    head = ["batch", "K", "plain step ms", "MTP step ms", "MTP/plain"] + [f"speedup a={a}" for a in ACCEPTANCE]
    head += ["shared step ms", "shared tok/step", "shared e2e speedup"]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for b in batches:
        base = plain.get(b, {})
        ks = sorted({k for m, k in by if m != "plain"})
        for k in ks:
            mtp, shared = by.get(("mtp", k), {}).get(b, {}), by.get(("shared_weights", k), {}).get(b, {})
            row = dict(batch=b, k=k, plain_step_ms=base.get("step_ms"), plain_gpu_ms=base.get("gpu_ms"),
                       mtp_step_ms=mtp.get("step_ms"), mtp_gpu_ms=mtp.get("gpu_ms"),
                       mtp_tokens_per_step=mtp.get("tokens_per_step"), shared_step_ms=shared.get("step_ms"),
                       shared_tokens_per_step=shared.get("tokens_per_step"))
            if base.get("step_ms") and mtp.get("step_ms"):
                row["mtp_over_plain"] = mtp["step_ms"] / base["step_ms"]
                row["implied_speedup"] = {str(a): expected_tokens(a, k) / row["mtp_over_plain"] for a in ACCEPTANCE}
            if base.get("e2e_tok_s") and shared.get("e2e_tok_s"):
                row["shared_e2e_speedup"] = shared["e2e_tok_s"] / base["e2e_tok_s"]
            rows.append(row)
            fmt = lambda v, d=3: "" if v is None else f"{v:.{d}f}"  # noqa: E731
            cells = [b, k, fmt(row["plain_step_ms"]), fmt(row["mtp_step_ms"]), fmt(row.get("mtp_over_plain"), 2)]
            cells += [fmt(row.get("implied_speedup", {}).get(str(a)), 2) for a in ACCEPTANCE]
            cells += [fmt(row["shared_step_ms"]), fmt(row["shared_tokens_per_step"], 2),
                      fmt(row.get("shared_e2e_speedup"), 2)]
            print("| " + " | ".join(map(str, cells)) + " |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a scaled-down model and workload, for the CPU")
    p.add_argument("--methods", default="plain,mtp,shared_weights", help="engines to run (plain: K = 0)")
    p.add_argument("--ks", default="1,2,3", help="draft tokens per step of the speculative engines")
    p.add_argument("--batch-sizes", default=None, help="default 1,16,64 (--tiny: 1,4)")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 128; --tiny: 16)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens (default 256; --tiny: 24)")
    p.add_argument("--level", type=int, default=None, help="atom's compilation level (default: atom's, 3)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (default: atom's, graphs)")
    p.add_argument("--timeout", type=int, default=450, help="seconds per engine")
    # a worker process: one engine
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--k", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.batch_sizes = args.batch_sizes or ("1,4" if args.tiny else "1,16,64")
    args.input_len = args.input_len or (16 if args.tiny else 128)
    args.output_len = args.output_len or (24 if args.tiny else 256)
    if args.worker:
        return worker(args)
    out = os.environ.get("OUT", "gpu-results")
    os.makedirs(out, exist_ok=True)
    path = model_dir(out, args.tiny)
    methods, ks = args.methods.split(","), [int(k) for k in args.ks.split(",")]
    engines = [(m, 0) for m in methods if m == "plain"] + [(m, k) for m in methods if m != "plain" for k in ks]
    results = [run_engine(m, k, path, out, args) for m, k in engines]
    rows = table(results, [int(b) for b in args.batch_sizes.split(",")])
    with open(os.path.join(out, "mtp_step_bench.json"), "w") as f:
        json.dump(dict(args=vars(args), engines=results, table=rows), f, indent=1)


if __name__ == "__main__":
    main()
