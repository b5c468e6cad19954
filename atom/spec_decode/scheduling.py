"""The scheduler's part of speculative decoding: how many drafts a row verifies, and the roll
back of rejected drafts. Request state stays the
scheduler's: these functions are called by it, on its sequences."""

from __future__ import annotations

from atom.core_types import PLACEHOLDER


def num_drafts_to_verify(seq, n: int, budget: int, max_seq_len: int) -> int:
    """Drafts a decode row (one new token, the last sampled) verifies this step: as many as
    the request has, the token budget allows and its length limits leave room for."""
    if n != 1 or seq.num_tokens - seq.num_computed_tokens != 1 or not seq.spec_token_ids:
        return 0
    left = min(seq.sampling_params.max_tokens - seq.num_output_tokens, max_seq_len - seq.num_tokens)
    return max(0, min(len(seq.spec_token_ids), budget - 1, left - 1))


def roll_back_drafts(seq, end: int, num_drafts: int, accepted: list[int]) -> int:
    """Keep the accepted drafts (the first ``len(accepted)``) of a verified row, drop the
    rest from its tokens and its computed count, and return the new index of the
    placeholder of the sampled token. ``end``: the placeholder's index before."""
    keep = end - num_drafts + len(accepted)
    assert seq.token_ids[keep - len(accepted) : keep] == accepted, "accepted tokens are not the drafts' prefix"
    del seq.token_ids[keep:]
    seq.token_ids.append(PLACEHOLDER)
    seq.num_computed_tokens -= num_drafts - len(accepted)
    return keep
