"""Teacher-forced top-1 agreement of two engines: both score the same token sequences (the
first engine's greedy continuations) and we count the positions, among those the first
engine is clear about, where their top-1 tokens agree. Used by the FP8 tests (CPU and GPU)."""

from __future__ import annotations

from atom.sampling_params import SamplingParams


def run(engine, prompts: list, params: SamplingParams) -> list:
    """The engine's final ``RequestOutput`` per prompt, in order."""
    ids = engine.add_request(prompts, params)
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def greedy_ids(engine, prompts: list, max_tokens: int) -> list[list[int]]:
    """Prompt token ids followed by the engine's greedy continuation, per prompt."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.prompt_token_ids) + list(o.token_ids) for o in run(engine, prompts, params)]


def top2(engine, sequences: list[list[int]], skip: int = 1) -> list[list[tuple[int, float]]]:
    """Per sequence, per position from ``skip`` on: (top-1 token, its logprob margin over the
    second) for predicting that position from the ones before."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    result = []
    for o in run(engine, sequences, params):
        rows = []
        for lp in o.prompt_logprobs[skip:]:
            (best, lp1), (_, lp2) = lp.top[0], lp.top[1]
            rows.append((best, lp1 - lp2))
        result.append(rows)
    return result


def teacher_forced_agreement(reference, candidate, prompts: list, max_tokens: int,
                             min_margin: float = 0.0) -> tuple[float, int]:
    """(fraction of clear positions where the top-1 agrees, number of clear positions); a
    position is clear when the reference's top-1 beats its second by more than ``min_margin``
    (in logprob)."""
    sequences = greedy_ids(reference, prompts, max_tokens)
    ref, cand = top2(reference, sequences), top2(candidate, sequences)
    pairs = [(r, c) for rs, cs in zip(ref, cand) for r, c in zip(rs, cs) if r[1] > min_margin]
    if not pairs:
        raise ValueError("no clear positions to compare")
    return sum(r[0] == c[0] for r, c in pairs) / len(pairs), len(pairs)


def decode_agreement(reference, candidate, prompts: list, max_tokens: int,
                     min_margin: float = 0.0) -> tuple[float, int]:
    """The same measure with the roles of decoding swapped: the candidate generates greedily
    (its decode path), the reference scores the candidate's sequences, and we count the clear
    positions where the candidate picked the reference's top-1. ``teacher_forced_agreement``
    scores both engines as prompts, which never runs a decode step."""
    sequences = greedy_ids(candidate, prompts, max_tokens)
    pairs = [(rows[pos - 1][0], seq[pos]) for seq, rows in zip(sequences, top2(reference, sequences))
             for pos in range(len(seq) - max_tokens, len(seq)) if rows[pos - 1][1] > min_margin]  # fmt: skip
    if not pairs:
        raise ValueError("no clear positions to compare")
    return sum(r == c for r, c in pairs) / len(pairs), len(pairs)
