"""Document by document: lm-eval ``--log_samples`` runs against a reference run.

    python -m atom.eval.compare_samples REF RUN [RUN ...] [--tasks atom_arc_easy,atom_lambada]

REF and each RUN are lm-eval output folders (``--output_path``; under ``python -m atom.eval.accuracy``
a workdir's ``results-hf`` or ``results-completions``), searched recursively for
``samples_TASK_*.jsonl``. For every task in both, per run: the documents compared, the largest and
mean absolute loglikelihood difference over all requests (loglikelihood tasks), the generations
identical to REF's (generate tasks), and for each per-document metric (acc, acc_norm, exact_match)
how many documents score differently and the net change. Two bf16 runs of one model move near-tied
multiple-choice answers both ways; the flips and their net say whether a score gap is that or a bias.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from dataclasses import dataclass, field

METRICS = ("acc", "acc_norm", "exact_match")


def read_samples(results_dir: str, task: str) -> dict[tuple[int, str], dict]:
    """(doc_id, filter) -> the logged sample of ``task`` under ``results_dir``."""
    paths = glob.glob(os.path.join(results_dir, "**", f"samples_{task}_*.jsonl"), recursive=True)
    if len(paths) != 1:
        raise FileNotFoundError(f"expected one samples file of {task} under {results_dir}, found {len(paths)}")
    with open(paths[0]) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {(row["doc_id"], row.get("filter", "none")): row for row in rows}


def tasks_in(results_dir: str) -> set[str]:
    names = glob.glob(os.path.join(results_dir, "**", "samples_*.jsonl"), recursive=True)
    return {os.path.basename(n)[len("samples_") :].rsplit("_", 1)[0] for n in names}


def loglikelihoods(row: dict) -> list[float] | None:
    """Each request's loglikelihood, or None for a generate task (its responses are text)."""
    resps = row["filtered_resps"]
    if resps and isinstance(resps[0], (list, tuple)):  # [loglikelihood, is_greedy] a request (maybe as text)
        return [float(r[0]) for r in resps]
    return None


@dataclass
class Comparison:
    docs: int = 0
    requests: int = 0
    max_diff: float = 0.0
    sum_diff: float = 0.0
    same_text: int = 0
    generated: int = 0
    differs: dict[str, int] = field(default_factory=dict)  # metric -> documents scoring differently
    net: dict[str, float] = field(default_factory=dict)  # metric -> run's sum minus the reference's


def compare(ref: dict[tuple[int, str], dict], run: dict[tuple[int, str], dict]) -> Comparison:
    missing = ref.keys() ^ run.keys()
    if missing:
        raise ValueError(f"the runs scored different documents ({len(missing)} differ, e.g. {sorted(missing)[:3]})")
    c = Comparison(docs=len(ref))
    for key, ref_row in ref.items():
        row = run[key]
        ref_ll, ll = loglikelihoods(ref_row), loglikelihoods(row)
        if ref_ll is not None and ll is not None:
            diffs = [abs(a - b) for a, b in zip(ll, ref_ll, strict=True)]
            c.requests += len(diffs)
            c.max_diff = max(c.max_diff, *diffs)
            c.sum_diff += sum(diffs)
        else:
            c.generated += 1
            c.same_text += row["filtered_resps"] == ref_row["filtered_resps"]
        for metric in METRICS:
            if metric in ref_row and metric in row:
                c.differs[metric] = c.differs.get(metric, 0) + (row[metric] != ref_row[metric])
                c.net[metric] = c.net.get(metric, 0.0) + float(row[metric]) - float(ref_row[metric])
    return c


def describe(c: Comparison) -> str:
    parts = [f"{c.docs} docs"]
    if c.requests:
        parts.append(f"max |dLL| {c.max_diff:.2e}, mean {c.sum_diff / c.requests:.2e} over {c.requests} requests")
    if c.generated:
        parts.append(f"{c.same_text}/{c.generated} generations identical")
    for metric, n in c.differs.items():
        parts.append(f"{metric}: {n} differ, net {c.net[metric]:+g}")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Comparison]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reference", help="the reference run's lm-eval output folder")
    p.add_argument("runs", nargs="+", help="output folders of the runs to compare with it")
    p.add_argument("--tasks", help="comma-separated task names (default: every task the reference logged)")
    args = p.parse_args(argv)
    tasks = args.tasks.split(",") if args.tasks else sorted(tasks_in(args.reference))
    out: dict[str, dict[str, Comparison]] = {}
    for task in tasks:
        ref = read_samples(args.reference, task)
        for run in args.runs:
            c = compare(ref, read_samples(run, task))
            out.setdefault(task, {})[run] = c
            print(f"{task:<16} {run}: {describe(c)}")
    return out


if __name__ == "__main__":
    main()
