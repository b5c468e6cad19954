"""Log-probabilities for the OpenAI ``logprobs`` fields: of sampled tokens, and of prompt
tokens (completions with ``echo``, as lm-eval's loglikelihood tasks need)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from atom.core_types import ScheduledRequest, TokenLogprobs

PROMPT_LOGPROBS_CHUNK = 512  # rows of logits materialised at a time for prompt logprobs


def top_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, n: int):
    """Log-probabilities (of the raw model distribution, as vLLM reports them) of
    ``token_ids`` and the top ``n`` per row: (chosen [B], top ids [B, n], top values [B, n], ranks [B])."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, token_ids.view(-1, 1).long()).squeeze(-1)
    top_vals, top_ids = logprobs.topk(n, dim=-1) if n > 0 else (logprobs[:, :0], logprobs[:, :0].long())
    ranks = (logprobs > chosen[:, None]).sum(-1) + 1
    return chosen, top_ids, top_vals, ranks


def token_logprobs(lp, j: int, token_id: int, n: int) -> TokenLogprobs:
    chosen, top_ids, top_vals, ranks = lp
    top = list(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist()))
    return TokenLogprobs(token_id, float(chosen[j]), int(ranks[j]), top)


def prompt_logprobs(compute_logits: Callable, hidden: torch.Tensor, seq: ScheduledRequest, start: int,
                    row0: int, n: int) -> list[TokenLogprobs]:
    """Logprobs of the prompt tokens this step's chunk predicts (``start+1 .. start+n``, each
    from the row before). The scheduler drops those already returned before a preemption."""
    count = min(n, seq.num_prompt_tokens - 1 - start)
    result, top_n = [], seq.sampling_params.prompt_logprobs
    for off in range(0, max(count, 0), PROMPT_LOGPROBS_CHUNK):
        m = min(PROMPT_LOGPROBS_CHUNK, count - off)
        logits = compute_logits(hidden[row0 + off : row0 + off + m])
        targets = torch.tensor(seq.token_ids[start + off + 1 : start + off + 1 + m], device=logits.device)
        lp = top_logprobs(logits, targets, top_n)
        result.extend(token_logprobs(lp, j, int(targets[j]), top_n) for j in range(m))
    return result
