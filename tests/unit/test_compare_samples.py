"""``python -m atom.eval.compare_samples`` over lm-eval sample logs written here in lm-eval 0.4's format."""

from __future__ import annotations

import json
import os

import pytest

from atom.eval import compare_samples


def write_run(folder, task: str, rows: list[dict]) -> str:
    """rows as lm-eval --log_samples writes them: one jsonl file a task, in a model's subfolder."""
    sub = os.path.join(folder, "some__model")
    os.makedirs(sub, exist_ok=True)
    with open(os.path.join(sub, f"samples_{task}_2026-12-01T15-42-50.123456.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(folder)


def mc(doc_id: int, lls: list[float], target: int) -> dict:
    best = max(range(len(lls)), key=lambda i: lls[i])
    return dict(doc_id=doc_id, filter="none", filtered_resps=[[str(x), "False"] for x in lls],
                acc=float(best == target), acc_norm=float(best == target))  # fmt: skip


def test_multiple_choice_flips_both_ways_and_their_net(tmp_path, capsys):
    ref = write_run(tmp_path / "ref", "atom_arc_easy", [mc(0, [-1.0, -2.0], 0), mc(1, [-3.0, -2.9], 0),
                                                         mc(2, [-5.0, -4.0], 1)])  # fmt: skip
    # doc 1 flips to right, doc 2 to wrong: two differ, net 0; the largest move is doc 1's 0.2
    run = write_run(tmp_path / "run", "atom_arc_easy", [mc(0, [-1.0, -2.0], 0), mc(1, [-2.8, -2.9], 0),
                                                         mc(2, [-4.0, -4.05], 1)])  # fmt: skip
    out = compare_samples.main([ref, run])
    c = out["atom_arc_easy"][run]
    assert (c.docs, c.requests) == (3, 6)
    assert c.max_diff == pytest.approx(1.0)
    assert c.sum_diff / c.requests == pytest.approx((0.2 + 1.0 + 0.05) / 6)
    assert c.differs == {"acc": 2, "acc_norm": 2} and c.net == {"acc": 0.0, "acc_norm": 0.0}
    assert "acc: 2 differ, net +0" in capsys.readouterr().out


def test_generations_and_exact_match_per_filter(tmp_path):
    def gen(doc_id, flt, text, em):
        return dict(doc_id=doc_id, filter=flt, filtered_resps=[text], exact_match=em)

    ref = write_run(tmp_path / "ref", "atom_gsm8k", [gen(0, "strict-match", "7", 1.0), gen(0, "flexible", "7", 1.0),
                                                     gen(1, "strict-match", "[invalid]", 0.0)])  # fmt: skip
    run = write_run(tmp_path / "run", "atom_gsm8k", [gen(0, "strict-match", "7", 1.0), gen(0, "flexible", "8", 0.0),
                                                     gen(1, "strict-match", "[invalid]", 0.0)])  # fmt: skip
    c = compare_samples.main([ref, run, "--tasks", "atom_gsm8k"])["atom_gsm8k"][run]
    assert (c.docs, c.requests, c.generated, c.same_text) == (3, 0, 3, 2)
    assert c.differs == {"exact_match": 1} and c.net == {"exact_match": -1.0}


def test_runs_over_other_documents_are_refused(tmp_path):
    ref = write_run(tmp_path / "ref", "t", [mc(0, [-1.0], 0), mc(1, [-1.0], 0)])
    run = write_run(tmp_path / "run", "t", [mc(0, [-1.0], 0)])
    with pytest.raises(ValueError, match="different documents"):
        compare_samples.main([ref, run])
    with pytest.raises(FileNotFoundError, match="samples file of other"):
        compare_samples.main([ref, run, "--tasks", "other"])
