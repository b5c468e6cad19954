"""Serve one random Qwen3-0.6B-shaped checkpoint with `python -m sglang.launch_server` twice, SGLang's own Qwen3 and
atom's (SGLANG_EXTERNAL_MODEL_PACKAGE=atom.plugin.sglang.models), send the same greedy /v1/completions to both and
compare the token ids, then score the same sequences (each prompt followed by native's output) on both, teacher-forced
(SGLang's /generate with input logprobs), for the top-1 agreement on clear positions that docs/performance.md uses
(native's top-2 logprob gap > 0.1). Runs on the GPU machine after install.sh (stdlib, torch, safetensors, tokenizers,
transformers):

    PYTHONPATH=/tmp/sglsite:$PWD python3 tools/sglang-gpu/compare_qwen3.py --out $OUT

Writes the checkpoint (config, N(0, 0.02) weights with norm weights 1, a word-level tokenizer that names every id)
into --model-dir, each server's log and compare.json into --out, and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

QWEN3_06B = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    rms_norm_eps=1e-06,
    rope_theta=1000000,
    hidden_act="silu",
    attention_bias=False,
    bos_token_id=151643,
    eos_token_id=151645,
    torch_dtype="bfloat16",
)
SPECIAL = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
SERVER_FLAGS = [
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--grammar-backend",
    "none",
    "--cuda-graph-backend-prefill",
    "disabled",
    "--cuda-graph-max-bs-decode",
    "8",
    "--mem-fraction-static",
    "0.5",
    "--context-length",
    "1024",
    "--dtype",
    "bfloat16",
    "--random-seed",
    "0",
    "--skip-server-warmup",
    "--served-model-name",
    "q3",
    "--host",
    "127.0.0.1",
]


def write_checkpoint(path: str, seed: int) -> None:
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(QWEN3_06B, f)
    c = QWEN3_06B
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (c["num_attention_heads"] * d, h),
                p + "self_attn.k_proj.weight": (c["num_key_value_heads"] * d, h),
                p + "self_attn.v_proj.weight": (c["num_key_value_heads"] * d, h),
                p + "self_attn.o_proj.weight": (h, c["num_attention_heads"] * d),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=g, device=device) * 0.02).to(torch.bfloat16).cpu()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if device == "cuda":
        torch.cuda.empty_cache()  # the servers size their KV pools from free memory
    vocab = {SPECIAL.get(t, f"t{t}"): t for t in range(c["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    ).save_pretrained(path)


def prompts(n: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(151000) for _ in range(rng.randrange(8, 48))] for _ in range(n)]


def start_server(model: str, port: int, atom: bool, extra: list[str], log_path: str) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("SGLANG_EXTERNAL_MODEL_PACKAGE", None)
    if atom:
        env["SGLANG_EXTERNAL_MODEL_PACKAGE"] = "atom.plugin.sglang.models"
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model,
        "--port",
        str(port),
        *SERVER_FLAGS,
        *extra,
    ]
    log = open(log_path, "w")
    log.write(" ".join(cmd) + "\n")
    log.flush()
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(proc: subprocess.Popen, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    return False


def complete(port: int, prompt: list[int], max_tokens: int) -> list[int]:
    body = json.dumps(
        {
            "model": "q3",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
    ).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]["token_ids"]


def score(port: int, ids: list[int]) -> list[tuple[int, float] | None]:
    """Teacher-forced: per position of ``ids``, the server's top-1 token and its logprob gap to the top-2 (None where
    SGLang gives no distribution, e.g. the first token)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 2}  # fmt: skip
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        tops = json.load(r)["meta_info"]["input_top_logprobs"]
    out = []
    for top in tops:  # each entry: [[logprob, token id, text], ...] or None
        if not top or len(top) < 2:
            out.append(None)
            continue
        first, second = sorted(top, key=lambda t: -t[0])[:2]
        out.append((int(first[1]), float(first[0]) - float(second[0])))
    return out


def agreement(native: list, atom: list, min_gap: float) -> tuple[int, int]:
    """(positions where atom's top-1 equals native's, positions) over native's positions with a top-2 gap > min_gap."""
    pairs = [(n, a) for ns, as_ in zip(native, atom) for n, a in zip(ns, as_) if n and a and n[1] > min_gap]
    return sum(n[0] == a[0] for n, a in pairs), len(pairs)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def wait_gpu_free(timeout: float = 60) -> None:
    """The next server sizes its KV pool from free memory: wait until the last one's processes let go."""
    import torch

    deadline = time.monotonic() + timeout
    while torch.cuda.is_available() and time.monotonic() < deadline:
        free, total = torch.cuda.mem_get_info()
        if free > 0.9 * total:
            return
        time.sleep(1)


def serve_and_generate(name: str, atom: bool, args, batch: list[list[int]], extra: list[str], to_score=None):
    """The server's greedy outputs for ``batch`` and its teacher-forced scores of ``to_score(outputs)`` (None if the
    server did not come up; scores None if scoring failed)."""
    log_path = os.path.join(args.out, f"{name}.log")
    t0 = time.monotonic()
    proc = start_server(args.model_dir, args.port, atom, extra, log_path)
    try:
        if not wait_ready(proc, args.port, args.start_timeout):
            print(f"{name}: server did not come up (exit {proc.poll()}); last lines of {log_path}:", flush=True)
            print("".join(open(log_path).readlines()[-25:]), flush=True)
            return None, None
        print(f"{name}: ready in {time.monotonic() - t0:.0f} s", flush=True)
        with ThreadPoolExecutor(len(batch)) as pool:  # one batch, as SGLang would get it from concurrent clients
            outputs = list(pool.map(lambda p: complete(args.port, p, args.max_tokens), batch))
        try:
            scores = [score(args.port, ids) for ids in to_score(outputs)]
        except (urllib.error.URLError, KeyError, TypeError, ValueError, IndexError) as e:
            print(f"{name}: teacher-forced scoring failed: {type(e).__name__}: {e}", flush=True)
            scores = None
        return outputs, scores
    finally:
        stop(proc)
        wait_gpu_free()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/sglang_compare"))
    ap.add_argument("--model-dir", default="/tmp/q3")
    ap.add_argument("--port", type=int, default=30010)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=240)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()
    write_checkpoint(args.model_dir, args.seed)
    print(f"checkpoint written in {time.monotonic() - t0:.0f} s", flush=True)
    batch = prompts(args.prompts, args.seed)
    native, native_scores = serve_and_generate(
        "native", False, args, batch, [], lambda outs: [p + o for p, o in zip(batch, outs)]
    )
    forced = [p + o for p, o in zip(batch, native or [])]  # atom scores native's sequences
    atom_graph = "decode CUDA graphs"
    atom, atom_scores = serve_and_generate("atom", True, args, batch, [], lambda _: forced)
    if atom is None:  # say what failed above, then try once more without CUDA graphs
        atom_graph = "no decode CUDA graphs"
        atom, atom_scores = serve_and_generate(
            "atom_eager", True, args, batch, ["--cuda-graph-backend-decode", "disabled"], lambda _: forced
        )
    logs = [os.path.join(args.out, f"{n}.log") for n in ("atom", "atom_eager")]
    proof = [ln.strip() for p in logs if os.path.exists(p) for ln in open(p) if "built for SGLang" in ln]
    print("atom's model in the atom server:", proof[-1] if proof else "NOT SEEN", flush=True)
    result = {"native": native, "atom": atom, "atom_mode": atom_graph, "prompts": batch, "atom_log": proof,
              "native_scores": native_scores, "atom_scores": atom_scores}  # fmt: skip
    with open(os.path.join(args.out, "compare.json"), "w") as f:
        json.dump(result, f)
    if native is None or atom is None:
        print(f"RESULT: not compared (native {'ok' if native else 'failed'}, atom {'ok' if atom else 'failed'})")
        sys.exit(1)
    print(
        f"\nSGLang 0.5.17 native Qwen3 vs atom's Qwen3 ({atom_graph}), greedy, "
        f"{len(batch)} prompts x {args.max_tokens} tokens"
    )
    print("| prompt | prompt len | identical | first divergence |")
    print("|---|---|---|---|")
    same = 0
    for k, (p, a, b) in enumerate(zip(batch, native, atom)):
        d = first_divergence(a, b)
        same += d is None
        print(f"| {k} | {len(p)} | {'yes' if d is None else 'no'} | {'-' if d is None else d} |")
    print(f"distinct tokens per native sequence: {[len(set(a)) for a in native]}; first native: {native[0][:12]}")
    if native_scores and atom_scores:
        for gap in (0.1, 0.5):
            agree, n = agreement(native_scores, atom_scores, gap)
            share = f"{agree}/{n} = {agree / max(n, 1):.2%}"
            print(f"teacher-forced top-1 agreement where native's top-2 gap > {gap}: {share}")
    print(f"RESULT: {same}/{len(batch)} sequences identical")


if __name__ == "__main__":
    main()
