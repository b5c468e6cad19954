"""Same-call serving comparison on the GPU: atom trees and vLLM behind their OpenAI servers,
one server at a time, ``benchmark_serving`` against each, a short table last.

    python tests/gpu/serve_compare.py --tokenizer DIR --tree after=. \
        --run after:qwen3-8b:sync --run after:qwen3-8b:async --run vllm:qwen3-8b

A run is ``TREE:MODEL[:FLAG,...]``; flags: ``async`` / ``sync`` (atom's scheduling mode; default: the tree's),
``mnbt=N`` (--max-num-batched-tokens), ``c=N`` (the client's concurrency; default --concurrency;
``c=1/16/64/256``: one measured pass per concurrency against the same server, each of
``min(--num-prompts, max(32, --prompts-per-client x N))`` prompts),
``tpN`` / ``dpN`` (-tp N / -dp N), ``ep`` (--enable-expert-parallel), ``fp8`` (--quantization fp8),
``fp8kv`` (--kv-cache-dtype fp8), for both engines; ``dpattn``
(atom's --enable-dp-attention; vLLM's equivalent is ``dpN,ep``: attention data-parallel, experts over the replicas),
``pc`` / ``nopc`` (prefix caching on / off: atom's default is off, vLLM's on), ``prefix=N`` (a shared
N-token prefix on every prompt, --random-prefix-len), ``plugin`` (vLLM runs: atom's plugin on; its entry
points must be importable, e.g. the dist-info directory of docs/plugin.md on PYTHONPATH).
Each pass records the prefix-cache hit rate the server's /metrics report for it.
Every run first sends a warm-up pass (Triton compiles
kernels on first use) and then the measured ones. Each pass samples its prompts with a seed of its
own (the same for every engine): with one seed, every pass would resend the prompts of the
passes before it, and vLLM, whose prefix cache is on by default, would serve those from cache.
atom runs write a step timeline (``ATOM_STEP_TRACE``) that is summarised in the table; the CPU seconds of the server's
processes during the measured pass are recorded too. Logs and JSON go to $OUT.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from atom.benchmarks.model_configs import model_dir  # noqa: E402

WARMUP_SEED = 1000  # the measured passes use seeds 1, 2, ...: no prompt is sent twice


def cpu_seconds(pid: int) -> dict[int, float]:
    """utime+stime of a process and its descendants, by pid."""
    out, todo = {}, [pid]
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            out[p] = (int(fields[11]) + int(fields[12])) / tick
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in open(f"/proc/{p}/task/{task}/children").read().split()]
        except OSError:
            pass
    return out


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return True
        except OSError:
            time.sleep(2)
    return False


def summarize_trace(path: str, since: float, until: float = float("inf")) -> dict:
    if not os.path.exists(path):
        return {}
    rows = [r for r in map(json.loads, open(path)) if since <= r.get("t", r.get("arrive")) < until]
    steps = [r for r in rows if "arrive" not in r]
    if not steps:
        return {}

    def mean(key, sel=steps):
        vals = [r[key] for r in sel if key in r]
        return round(sum(vals) / len(vals), 3) if vals else None

    mixed = [r for r in steps if r["prefills"]]
    gpu = sorted(r.get("gpu_ms", 0) for r in steps)
    return {
        "steps": len(steps),
        "mixed_steps": len(mixed),
        "gpu_ms": mean("gpu_ms"),
        "gap_ms": mean("gap_ms"),
        "gap_total_s": round(sum(r.get("gap_ms", 0) for r in steps) / 1000, 2),
        "gpu_total_s": round(sum(gpu) / 1000, 2),
        "gpu_p99_ms": gpu[int(0.99 * (len(gpu) - 1))],
        "sched_ms": mean("sched_ms"),
        "launch_ms": mean("launch_ms"),
        "wait_ms": mean("wait_ms"),
        "collect_ms": mean("collect_ms"),
        "decodes": mean("decodes"),
        "mixed_prefill_tokens": mean("prefill_tokens", mixed),
        "mixed_gpu_ms": mean("gpu_ms", mixed),
        "decode_gpu_ms": mean("gpu_ms", [r for r in steps if not r["prefills"]]),
    }


def run_one(spec: str, args, trees: dict[str, str], port: int) -> list[dict]:
    tree, model, *rest = spec.split(":")
    flags = rest[0].split(",") if rest else []
    name = spec.replace(":", "_").replace(",", "-").replace("=", "").replace("/", "-")
    path = os.path.abspath(trees[next(iter(trees))] if tree == "vllm" else trees[tree])
    mdir = model_dir(model)
    for f in os.listdir(args.tokenizer):
        if f.startswith("tokenizer") or f.endswith(".jinja"):
            shutil.copy(os.path.join(args.tokenizer, f), mdir)
    trace = os.path.join(args.out, f"trace_{name}.jsonl")
    if os.path.exists(trace):
        os.remove(trace)
    env = dict(
        os.environ,
        PYTHONPATH=":".join(p for p in ("/tmp/site", path, "/tmp/atom_ep") if os.path.isdir(p)),
        ATOM_DISABLE_VLLM_PLUGIN="0" if "plugin" in flags else "1",
        PYTHONUNBUFFERED="1",
        ATOM_STEP_TRACE=trace,
    )
    mnbt = [f.split("=")[1] for f in flags if f.startswith("mnbt=")]
    concurrency = next((f.split("=")[1] for f in flags if f.startswith("c=")), str(args.concurrency)).split("/")
    if tree == "vllm":
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            mdir,
            "--load-format",
            "dummy",
            "--max-model-len",
            str(args.max_model_len),
            "--port",
            str(port),
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "atom.entrypoints.openai_server",
            mdir,
            "--load_dummy",
            "--max-model-len",
            str(args.max_model_len),
            "--port",
            str(port),
            "--disable-uvicorn-access-log",
        ]
        cmd += ["--async-scheduling"] if "async" in flags else []
        cmd += ["--no-async-scheduling"] if "sync" in flags else []
    cmd += ["--max-num-batched-tokens", mnbt[0]] if mnbt else []
    cmd += ["--enable-expert-parallel"] if "ep" in flags else []
    cmd += ["--enable-dp-attention"] if "dpattn" in flags else []
    cmd += ["--quantization", "fp8"] if "fp8" in flags else []
    cmd += ["--kv-cache-dtype", "fp8"] if "fp8kv" in flags else []
    cmd += ["--enable-prefix-caching"] if "pc" in flags else []
    cmd += ["--no-enable-prefix-caching"] if "nopc" in flags else []
    cmd += [a for f in flags if f[:2] in ("tp", "dp") and f[2:].isdigit() for a in (f"-{f[:2]}", f[2:])]
    results, start_s = [], None
    log = open(os.path.join(args.out, f"log_{name}.txt"), "w")
    start = time.time()
    server = subprocess.Popen(cmd, cwd=path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if not wait_healthy(port, server, args.start_timeout):
            return [{"run": spec, "error": "server did not start"}]
        start_s = round(time.time() - start, 1)
        bench = [
            sys.executable,
            "-m",
            "atom.benchmarks.benchmark_serving",
            "--backend",
            "vllm",
            "--port",
            str(port),
            "--model",
            mdir,
            "--dataset-name",
            "random",
            "--random-input-len",
            str(args.input_len),
            "--random-output-len",
            str(args.output_len),
            "--random-prefix-len",
            next((f.split("=")[1] for f in flags if f.startswith("prefix=")), "0"),
            "--request-rate",
            "inf",
            "--ignore-eos",
            "--disable-tqdm",
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
            "--metric-percentiles",
            "50,90,99",
        ]
        first = os.path.abspath(trees[next(iter(trees))])
        benv = dict(env, PYTHONPATH=":".join(p for p in ("/tmp/site", first) if os.path.isdir(p)))
        with open(os.path.join(args.out, f"log_{name}.txt"), "a") as blog:
            subprocess.run(
                bench + ["--max-concurrency", max(concurrency, key=int), "--num-prompts", str(args.warmup_prompts)]
                + ["--seed", str(WARMUP_SEED)],
                cwd=path,
                env=benv,
                stdout=blog,
                stderr=subprocess.STDOUT,
                timeout=args.timeout,
            )
            if os.path.exists(trace):
                os.remove(trace)  # the warm-up pass's steps
            for seed, c in enumerate(concurrency, start=1):
                label = f"{tree}:{model}:" + ",".join([f for f in flags if not f.startswith("c=")] + [f"c={c}"])
                results.append(measured_pass(label, name, c, seed, bench, path, benv, blog, server, trace, args,
                                             port))  # fmt: skip
                results[-1]["start_s"] = start_s
                # now, in case a later pass does not finish (its trace summary comes at the end)
                print("pass:", json.dumps({k: v for k, v in results[-1].items() if k != "window"}), flush=True)
    except subprocess.TimeoutExpired:
        results.append({"run": spec, "error": "benchmark timed out", "start_s": start_s})
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
    for r in results:
        r["trace"] = summarize_trace(trace, *r.pop("window")) if "window" in r else {}
    return results


def prefix_cache_counts(port: int) -> tuple[float, float]:
    """(queried, hit) prompt tokens of the prefix cache so far, from the server's /metrics
    (``atom:prefix_cache_*`` or ``vllm:prefix_cache_*_total``); zeros where it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:
        return 0.0, 0.0
    counts = {"queries": 0.0, "hits": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            kind = sample.name.split(":")[-1].removesuffix("_total").removeprefix("prefix_cache_")
            if kind in counts:
                counts[kind] += sample.value
    return counts["queries"], counts["hits"]


def measured_pass(label, name, c, seed, bench, path, benv, blog, server, trace, args, port) -> dict:
    """One measured ``benchmark_serving`` pass at concurrency ``c``; its step-trace window is
    summarised once the server has flushed the trace (at exit)."""
    prompts = min(args.num_prompts, max(32, args.prompts_per_client * int(c)))
    result = {"run": label, "concurrency": int(c), "prompts": prompts}
    res = os.path.join(args.out, f"serve_{name}_c{c}.json")
    (queried, hit), before, since = prefix_cache_counts(port), cpu_seconds(server.pid), time.time()
    subprocess.run(
        bench
        + ["--max-concurrency", c, "--num-prompts", str(prompts), "--seed", str(seed)]
        + ["--save-result", "--result-dir", args.out]
        + ["--result-filename", os.path.basename(res)],
        cwd=path,
        env=benv,
        stdout=blog,
        stderr=subprocess.STDOUT,
        timeout=args.timeout,
    )
    after = cpu_seconds(server.pid)
    result["window"] = (since, time.time())
    queried2, hit2 = prefix_cache_counts(port)
    result["prefix_hit_pct"] = round(100 * (hit2 - hit) / (queried2 - queried), 1) if queried2 > queried else 0.0
    used = {p: after[p] - before.get(p, 0) for p in after}
    result["cpu_s"] = {str(p): round(s, 1) for p, s in used.items() if s > 1}
    if os.path.exists(res):
        r = json.load(open(res))
        keep = ("output_throughput", "duration", "completed", "request_throughput")
        result.update({k: r[k] for k in r if k.endswith("_ms") or k in keep})
        os.remove(res)  # per-request lists; the device tool brings back few files
    return result


def main() -> None:
    # a SIGTERM (an outer `timeout`) unwinds like Ctrl-C, so the finally blocks stop the run's own
    # process group (started in a session of its own): a benchmark left running holds the GPUs
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH of an atom checkout")
    p.add_argument("--run", action="append", default=[], help="TREE:MODEL[:FLAGS]")
    p.add_argument("--tokenizer", required=True, help="a directory with tokenizer files (copied into the shape dir)")
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--warmup-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--prompts-per-client", type=int, default=8, help="prompts of a pass per unit of concurrency")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--timeout", type=int, default=400, help="seconds per benchmark pass")
    args = p.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    args.out = os.path.abspath(os.environ.get("OUT", "gpu-results"))
    os.makedirs(args.out, exist_ok=True)
    results = []
    for i, spec in enumerate(args.run):
        for r in run_one(spec, args, trees, 8100 + i):
            results.append(r)
            print(json.dumps(r), flush=True)
        json.dump(results, open(f"{args.out}/serve_compare.json", "w"), indent=1)
    print("\n| run | tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | ITL p99 | prefix hits % | steps | gpu ms | gap ms "
          "| host ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    def f(x) -> str:
        return f"{x:.1f}" if isinstance(x, float) else str(x)

    for r in results:
        t = r.get("trace", {})
        host = "/".join(str(t.get(k)) for k in ("sched_ms", "launch_ms", "collect_ms")) if t else ""
        print(
            f"| {r['run']} | {f(r.get('output_throughput', r.get('error', '')))} | {f(r.get('p50_ttft_ms'))}/"
            f"{f(r.get('p99_ttft_ms'))} | {f(r.get('p50_tpot_ms'))}/{f(r.get('p99_tpot_ms'))} | "
            f"{f(r.get('p99_itl_ms'))} | {r.get('prefix_hit_pct', '')} | {t.get('steps', '')} | "
            f"{t.get('gpu_ms', '')} | {t.get('gap_ms', '')} | "
            f"{host} |"
        )


if __name__ == "__main__":
    main()
