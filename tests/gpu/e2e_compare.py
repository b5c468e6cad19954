"""Same-call end-to-end comparison on the GPU: several atom trees (e.g. before/after a change)
and vLLM, one benchmark process per run, a short table last.

    python tests/gpu/e2e_compare.py --tree after=. --tree before=.stage_before \
        --run after:qwen3-0.6b:async --run before:qwen3-0.6b:async --run vllm:qwen3-0.6b

A run is ``TREE:MODEL[:FLAG,...]`` with TREE a ``--tree`` name or ``vllm`` (vLLM native on the
first tree's PYTHONPATH with the plugin disabled); flags: ``async`` (--async-scheduling),
``sync`` (--no-async-scheduling), ``eager`` (--enforce-eager), ``latency`` (benchmark_latency
instead of benchmark_throughput), ``tpN`` (-tp N), ``ep`` (--enable-expert-parallel), ``levelN`` (atom's --level N),
``nocar`` (--disable-custom-all-reduce: NCCL for every all-reduce), ``fp8`` (--quantization fp8: weights
quantised on load), ``fp8kv`` (--kv-cache-dtype fp8), ``bsN`` (--block-size N). FP8 checkpoints: the
models ``qwen3-8b-fp8`` and ``qwen3-30b-a3b-fp8`` (block-128 e4m3 weights, as Qwen's FP8 releases).
A run may be listed more than once: list a pair as A B B A, since the order of the processes
in a machine session may matter (session 15: the second of two vLLM processes ran the same
Python ~1.3x slower; each run's log starts with the busiest processes of the machine).
Each run's log and JSON go to $OUT (or ./gpu-results), named by position and run. A run that times out has its whole
process group killed (engine and rank processes included), after ``py-spy dump`` of every
process in it where ``py-spy`` is on PATH, else a SIGABRT to each, which ``PYTHONFAULTHANDLER`` turns
into every thread's Python stack (the stacks go to the run's log).
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


def run_one(spec: str, trees: dict[str, str], out: str, timeout: int, index: int = 0) -> dict:
    tree, model, *rest = spec.split(":")
    flags = rest[0].split(",") if rest else []
    engine = "vllm" if tree == "vllm" else "atom"
    path = os.path.abspath(trees[next(iter(trees))] if engine == "vllm" else trees[tree])
    bench = "benchmark_latency" if "latency" in flags else "benchmark_throughput"
    name = f"{index}_" + spec.replace(":", "_").replace(",", "-")
    cmd = [sys.executable, "-m", f"atom.benchmarks.{bench}", "--engine", engine, "--model", model,
           "--output-json", f"{out}/{name}.json"]
    cmd += ["--async-scheduling"] if "async" in flags else []
    cmd += ["--no-async-scheduling"] if "sync" in flags else []
    cmd += ["--enforce-eager"] if "eager" in flags else []
    cmd += ["--enable-expert-parallel"] if "ep" in flags else []
    cmd += ["--disable-custom-all-reduce"] if "nocar" in flags else []
    cmd += ["--quantization", "fp8"] if "fp8" in flags else []
    cmd += ["--kv-cache-dtype", "fp8"] if "fp8kv" in flags else []
    cmd += [a for f in flags if f.startswith("tp") for a in ("-tp", f[2:])]
    cmd += [a for f in flags if f.startswith("level") for a in ("--level", f[5:])]
    cmd += [a for f in flags if f.startswith("bs") for a in ("--block-size", f[2:])]
    env = dict(os.environ, PYTHONPATH=":".join(p for p in ("/tmp/site", path) if os.path.isdir(p)),
               ATOM_DISABLE_VLLM_PLUGIN="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    start = time.time()
    with open(f"{out}/{name}.log", "w") as log:
        log.write(busiest_processes())
        log.flush()
        proc = subprocess.Popen(cmd, cwd=path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
            dump_stacks(proc.pid, log)
        finally:  # the engine core and rank processes too, so that the next run gets the GPUs
            kill_group(proc)
    result = {"run": spec, "rc": rc, "wall_s": round(time.time() - start, 1)}
    if os.path.exists(f"{out}/{name}.json"):
        result.update(json.load(open(f"{out}/{name}.json")))
    return result


def busiest_processes(n: int = 4) -> str:
    """The machine's busiest processes now (a leftover of an earlier run would show here)."""
    ps = subprocess.run(["ps", "-eo", "pcpu,etime,args", "--sort=-pcpu"], capture_output=True, text=True)
    return "".join(line[:160] + "\n" for line in ps.stdout.splitlines()[: n + 1])


def dump_stacks(pgid: int, log) -> None:
    """Where a hung run's processes are, into its log: py-spy's Python stacks of each or, without py-spy (the
    GPU machine has none), SIGABRT, on which ``PYTHONFAULTHANDLER`` (set for every run) prints each thread's
    stack to the log before the process dies."""
    pids = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout.split()
    log.flush()
    if shutil.which("py-spy") is None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGABRT)
        time.sleep(5)
        return
    for pid in pids:
        log.flush()
        subprocess.run(["py-spy", "dump", "--pid", pid], stdout=log, stderr=subprocess.STDOUT, timeout=60)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main() -> None:
    # a SIGTERM (an outer `timeout`) unwinds like Ctrl-C, so the finally blocks stop the run's own
    # process group (started in a session of its own): a benchmark left running holds the GPUs
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH of an atom checkout")
    p.add_argument("--run", action="append", default=[], help="TREE:MODEL[:FLAGS]")
    p.add_argument("--timeout", type=int, default=240, help="seconds per run")
    args = p.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    out = os.environ.get("OUT", "gpu-results")
    os.makedirs(out, exist_ok=True)
    results = []
    for i, spec in enumerate(args.run):
        results.append(run_one(spec, trees, out, args.timeout, i))
        print(json.dumps(results[-1]), flush=True)
    json.dump(results, open(f"{out}/e2e_compare.json", "w"), indent=1)
    print("\n| run | rc | wall s | output tok/s | TPOT ms |\n|---|---|---|---|---|")
    for r in results:
        tpot = r.get("tpot_ms", r.get("median_tpot_ms", ""))
        print(f"| {r['run']} | {r['rc']} | {r['wall_s']} | {r.get('output_tokens_per_s', '')} | {tpot} |")


if __name__ == "__main__":
    main()
