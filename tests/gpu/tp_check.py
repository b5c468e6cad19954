"""Tensor parallelism on 2 GPUs: tp=1 vs tp=2 on the same random-weight checkpoints.

    python tests/gpu/tp_check.py [--budget-s 280]

For each model shape (Qwen3-0.6B, Qwen3-8B, Qwen3-30B-A3B with fewer layers and
``--enable-expert-parallel``) a checkpoint with random weights is written once (transformers'
own init, so every rank loads the same weights), then each engine configuration runs in its
own process (a tp=1 engine holds GPU 0 in the process that made it):

- identity: 8 greedy generations of 64 tokens (exact match, first divergence), and
  teacher-forced top-1 agreement over 4 x 256 fixed prompt positions (``prompt_logprobs=2``),
  on all positions and on the clear ones (top-2 gap of the tp=1 run > 0.1 nats);
- throughput: ``benchmark_throughput``'s workload (temperature 0.6, ignore_eos) after a short
  warm-up that JIT-compiles the Triton variants outside the timed region;
- batch-1 decode: one 32-token prompt, 128 tokens, time per output token.

Runs go in priority order and stop when ``--budget-s`` is spent; JSON per run and a
summary go to $OUT (or ./gpu-results); a short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

SHAPES = {  # model_configs shape, layers kept (None: all)
    "qwen3-0.6b": ("qwen3-0.6b", None),
    "qwen3-8b": ("qwen3-8b", None),
    "qwen3-30b-a3b-12l": ("qwen3-30b-a3b", 12),
}
# (shape, tp, mode, extra): extra "ep" = --enable-expert-parallel, "dp2" = -dp 2 (a replica
# per GPU; needs pyzmq there), "nccl" = --disable-custom-all-reduce; mode "graphs" = CUDA
# graphs without torch.compile (level 0), "compile" = the default level 3, "eager" =
# --enforce-eager, "fp32" = float32 weights and activations, identity only (no timing): the
# reference that tells TP's own error from bf16 noise
RUNS = [
    ("qwen3-8b", 1, "graphs", ""),
    ("qwen3-8b", 2, "graphs", ""),
    ("qwen3-8b", 1, "fp32", ""),
    ("qwen3-8b", 2, "fp32", ""),
    ("qwen3-8b", 2, "graphs", "nccl"),
    ("qwen3-30b-a3b-12l", 1, "graphs", ""),
    ("qwen3-30b-a3b-12l", 2, "graphs", "ep"),
    ("qwen3-0.6b", 1, "graphs", ""),
    ("qwen3-0.6b", 2, "graphs", ""),
    ("qwen3-8b", 1, "graphs", "dp2"),
    ("qwen3-0.6b", 2, "compile", ""),
    ("qwen3-0.6b", 1, "eager", ""),
    ("qwen3-0.6b", 2, "eager", ""),
]
GEN_TOKENS, TF_LEN, CLEAR_GAP = 64, 256, 0.1
MAX_LEN = int(os.environ.get("TP_CHECK_MAX_LEN", 4096))  # a CPU dry run's tiny model has less


def run_name(shape: str, tp: int, mode: str, extra: str) -> str:
    return f"{shape}_tp{tp}_{mode}{'_' + extra if extra else ''}"


def build(shape: str, out_dir: str) -> str:
    """A checkpoint of ``shape`` with random bf16 weights, made on the GPU (fast) and saved
    to ``out_dir`` (use /dev/shm: a 16 GB write to RAM takes seconds)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from atom.benchmarks.model_configs import CONFIGS

    name, layers = SHAPES[shape]
    spec = dict(CONFIGS[name])
    if layers is not None:
        spec["num_hidden_layers"] = layers
    # a wider init than 0.02 gives less flat logits (fewer bf16 near-ties)
    cfg = AutoConfig.for_model(spec.pop("model_type"), initializer_range=0.05, **spec)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    path = os.path.join(out_dir, shape)
    model.save_pretrained(path)
    return path


def run_one(path: str, tp: int, mode: str, extra: str, num_seqs: int) -> dict:
    from atom import LLMEngine, SamplingParams
    from atom.benchmarks.benchmark_throughput import workload

    kwargs = dict(skip_tokenizer_init=True, max_model_len=MAX_LEN, tensor_parallel_size=tp,
                  data_parallel_size=2 if "dp2" in extra else 1, enable_expert_parallel="ep" in extra,
                  enforce_eager=mode == "eager", disable_custom_all_reduce="nccl" in extra)
    if mode == "fp32":
        kwargs["dtype"] = "float32"
    if mode != "compile":
        kwargs["level"] = 0
    t0 = time.perf_counter()
    llm = LLMEngine(path, **kwargs)
    result = dict(startup_s=round(time.perf_counter() - t0, 1))
    rng, vocab = random.Random(1), min(10000, llm.config.model_config.hf_config.vocab_size - 1)
    gen_prompts = [[rng.randint(0, vocab) for _ in range(rng.randint(32, 200))] for _ in range(8)]
    tf_prompts = [[rng.randint(0, vocab) for _ in range(TF_LEN)] for _ in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=GEN_TOKENS, ignore_eos=True)
    result["greedy"] = [o["token_ids"] for o in llm.generate(gen_prompts, greedy, use_tqdm=False)]
    ids = llm.add_request(tf_prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    done = {}
    while len(done) < len(ids):
        done.update({o.request_id: o for o in llm.step()})
    # per position: (top-1 id, top-1 minus top-2 logprob)
    result["teacher_forced"] = [[(lp.top[0][0], lp.top[0][1] - lp.top[1][1]) for lp in done[i].prompt_logprobs[1:]]
                                for i in ids]
    if mode == "fp32":
        llm.shutdown()
        return result
    prompts, max_tokens = workload(num_seqs, 1024, 1024)
    prompts = [[t % vocab for t in p] for p in prompts]  # a tiny CPU checkpoint's vocabulary
    warm = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=16)
    llm.generate(prompts[:16], warm, use_tqdm=False)  # Triton variants compile here, untimed
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    result.update(output_tokens=sum(max_tokens), elapsed_s=round(elapsed, 2),
                  output_tokens_per_s=round(sum(max_tokens) / elapsed, 1))
    one = SamplingParams(temperature=0, ignore_eos=True, max_tokens=128)
    out = llm.generate([gen_prompts[0][:32]], one, use_tqdm=False)[0]
    result["batch1_tpot_ms"] = round(out["tpot"] * 1000, 2)
    llm.shutdown()
    return result


def tf_agreement(ref: dict, run: dict) -> tuple[float, float, int]:
    """Teacher-forced top-1 agreement (%) on all positions and on those where ``ref``'s top-2 gap
    is over CLEAR_GAP, and how many those are."""
    pairs = [(r, s) for rr, ss in zip(ref["teacher_forced"], run["teacher_forced"]) for r, s in zip(rr, ss)]
    clear = [(r, s) for r, s in pairs if r[1] > CLEAR_GAP]
    agree = lambda ps: round(100.0 * sum(r[0] == s[0] for r, s in ps) / max(1, len(ps)), 2)
    return agree(pairs), agree(clear), len(clear)


def compare(ref: dict, run: dict) -> dict:
    """Greedy exact matches / first divergence, teacher-forced top-1 agreement."""
    first = []
    for a, b in zip(ref["greedy"], run["greedy"]):
        first.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None))
    every, clear, n = tf_agreement(ref, run)
    return dict(greedy_identical=sum(f is None for f in first), greedy_total=len(first),
                first_divergence=[f for f in first if f is not None], tf_agree_pct=every,
                tf_clear_agree_pct=clear, tf_clear_positions=n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=280.0, help="stop starting runs after this many seconds")
    p.add_argument("--num-seqs", type=int, default=256, help="throughput workload size")
    p.add_argument("--ckpt-dir", default="/dev/shm/atom-tp-check")
    p.add_argument("--select", default="", help="only the runs whose name contains this, e.g. tp1_graphs")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: one run (JSON spec) in this process
    args = p.parse_args()
    out = os.environ.get("OUT", "gpu-results")
    os.makedirs(out, exist_ok=True)
    if args.one:
        spec = json.loads(args.one)
        if spec["what"] == "build":
            print(json.dumps({"path": build(spec["shape"], args.ckpt_dir)}))
        else:
            res = run_one(spec["path"], spec["tp"], spec["mode"], spec["extra"], spec["num_seqs"])
            with open(spec["json"], "w") as f:
                json.dump(res, f)
        return
    start, results, paths = time.monotonic(), [], {}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log_path = f"{out}/tp_check.log"  # every run's output, in order (the device returns few files)

    def sub(spec: dict, timeout: float) -> int | str:
        with open(log_path, "a") as log:
            log.write(f"\n===== {json.dumps(spec)}\n")
            offset = log.tell()
            try:
                rc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec), "--ckpt-dir", args.ckpt_dir],
                                    env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if rc != 0:  # its last lines, for the caller's output tail
            with open(log_path) as log:
                log.seek(offset)
                print("".join(log.readlines()[-25:]), flush=True)
        return rc

    queue, graphs_broken = [r for r in RUNS if args.select in run_name(*r)], False
    while queue:
        shape, tp, mode, extra = queue.pop(0)
        if graphs_broken and tp > 1 and mode != "eager":
            mode = "eager"  # CUDA graphs with the collectives failed once: see the rest eagerly
        left = args.budget_s - (time.monotonic() - start)
        name = run_name(shape, tp, mode, extra)
        if left < 30:
            results.append(dict(run=name, rc="skipped (budget)"))
            continue
        if shape not in paths:
            t = time.monotonic()
            rc = sub(dict(what="build", shape=shape), left)
            paths[shape] = os.path.join(args.ckpt_dir, shape) if rc == 0 else None
            print(f"build {shape}: rc={rc} {time.monotonic() - t:.0f} s", flush=True)
        if paths[shape] is None:
            results.append(dict(run=name, rc="no checkpoint"))
            continue
        num_seqs = args.num_seqs if mode != "eager" else args.num_seqs // 4
        t = time.monotonic()
        spec = dict(what="run", path=paths[shape], tp=tp, mode=mode, extra=extra, num_seqs=num_seqs,
                    json=f"/tmp/tp_check_{name}.json")
        rc = sub(spec, args.budget_s - (time.monotonic() - start))
        res = dict(run=name, shape=shape, tp=tp, mode=mode, extra=extra, rc=rc, wall_s=round(time.monotonic() - t, 1),
                   num_seqs=num_seqs)
        if rc == 0:
            res.update(json.load(open(spec["json"])))
        elif tp > 1 and mode == "graphs" and not graphs_broken:
            graphs_broken = True
            eager = [(shape, 1, "eager", ""), (shape, 2, "eager", "")]
            queue = eager + [q for q in queue if q not in eager]
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k not in ("greedy", "teacher_forced")}), flush=True)
    one = {(r["shape"], r["mode"]): r for r in results if r.get("tp") == 1 and not r.get("extra") and "greedy" in r}
    for r in results:
        ref = one.get((r.get("shape"), r.get("mode"))) or one.get((r.get("shape"), "graphs"))
        if r is not ref and "greedy" in r and ref is not None:
            r["vs_tp1"] = dict(compare(ref, r), ref=ref["run"])
        fp32 = one.get((r.get("shape"), "fp32"))
        if r is not fp32 and "greedy" in r and fp32 is not None:  # bf16 (or TP) error against float32
            r["vs_fp32_tp1"] = dict(zip(("tf_agree_pct", "tf_clear_agree_pct", "tf_clear_positions"),
                                        tf_agreement(fp32, r)))
    summary = [{k: v for k, v in r.items() if k not in ("greedy", "teacher_forced")} for r in results]
    json.dump(summary, open(f"{out}/tp_check.json", "w"), indent=1)
    print("\n| run | rc | start s | tok/s | b1 TPOT ms | greedy same | TF top-1 % (clear) | vs fp32 tp1 (clear) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in summary:
        v, f = r.get("vs_tp1", {}), r.get("vs_fp32_tp1", {})
        same = f"{v['greedy_identical']}/{v['greedy_total']}" if v else ""
        tf = f"{v['tf_agree_pct']} ({v['tf_clear_agree_pct']}, n={v['tf_clear_positions']})" if v else ""
        tf32 = f"{f['tf_agree_pct']} ({f['tf_clear_agree_pct']}, n={f['tf_clear_positions']})" if f else ""
        print(f"| {r['run']} | {r['rc']} | {r.get('startup_s', '')} | {r.get('output_tokens_per_s', '')} | "
              f"{r.get('batch1_tpot_ms', '')} | {same} | {tf} | {tf32} |")


if __name__ == "__main__":
    main()
