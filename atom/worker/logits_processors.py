"""What edits the logits before temperature, in one batched pass: the grammar mask of
structured output, then the penalties and masks of ``penalty_inputs`` (vLLM's order; the
grammar mask commutes with them, so it joins ``allowed_token_ids`` as one bitmask)."""

from __future__ import annotations

import dataclasses

import torch

from atom import ops
from atom.core_types import PLACEHOLDER, ScheduledRequest
from atom.worker.penalty_inputs import PenaltyInputs, RequestPenalties, build_penalty_inputs


def _neutral(rows: int, device: torch.device) -> PenaltyInputs:
    zeros = torch.zeros(rows, dtype=torch.float32, device=device)
    return PenaltyInputs(zeros, zeros, torch.ones_like(zeros), None, None, None, None, None, None)


def apply_logits_processors(
    logits: torch.Tensor, penalties: PenaltyInputs | None, grammar_bitmask: torch.Tensor | None
) -> torch.Tensor:
    """Float32 logits with both applied (``logits`` itself when neither is given).
    ``grammar_bitmask``: int32 [>= B, ceil(V / 32)] on any device, rows past B ignored."""
    if penalties is None and grammar_bitmask is None:
        return logits
    rows = logits.shape[0]
    penalties = penalties or _neutral(rows, logits.device)
    if grammar_bitmask is not None:
        mask = grammar_bitmask[:rows].to(logits.device, non_blocking=True)
        if penalties.allowed_bitmask is not None:
            mask = mask & penalties.allowed_bitmask
        penalties = dataclasses.replace(penalties, allowed_bitmask=mask)
    return ops.apply_penalties(logits, *penalties.args())  # Triton on CUDA, the reference elsewhere


def process_logits(
    logits: torch.Tensor, seqs: list[ScheduledRequest], grammar_bitmask: torch.Tensor | None = None
) -> torch.Tensor:
    """Penalties, logit_bias, the token masks and the grammar bitmask of the batch (``logits``
    itself when no request asks for any). The counts and grammar states follow every sampled
    token: the engine runs such requests without async scheduling."""
    inputs = None
    if any(s.sampling_params.processes_logits for s in seqs):
        inputs = build_penalty_inputs([_penalties(s) for s in seqs], logits.shape[1], logits.device)
    return apply_logits_processors(logits, inputs, grammar_bitmask)


def _penalties(seq: ScheduledRequest) -> RequestPenalties:
    p = seq.sampling_params
    if not p.processes_logits:
        return RequestPenalties((), ())
    out = seq.token_ids[seq.num_prompt_tokens :]
    if out and out[-1] == PLACEHOLDER:  # the token this step samples
        out = out[:-1]
    return RequestPenalties(
        prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
        output_token_ids=out,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logit_bias=p.logit_bias,
        min_tokens=p.min_tokens,
        stop_token_ids=[*seq.eos_token_ids, *p.stop_token_ids],  # vLLM: EOS even with ignore_eos
        bad_words_token_ids=p.bad_words_token_ids or (),
        allowed_token_ids=p.allowed_token_ids,
    )
