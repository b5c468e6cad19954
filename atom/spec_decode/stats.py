"""Acceptance statistics of speculative decoding: counted by the scheduler, reported by
``LLMEngine.print_mtp_statistics()``, the server's ``/metrics`` and a log line every 1000
draft tokens."""

from __future__ import annotations

import logging

import msgspec

logger = logging.getLogger(__name__)

_LOG_EVERY = 1000  # draft tokens


class SpecDecodeStats(msgspec.Struct, frozen=True):
    """Since start-up: verify steps (rows with drafts), draft tokens, accepted ones, and
    drafts and acceptances by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = []
    accepted_per_position: list[int] = []

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step: the accepted drafts plus the one sampled token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def per_position_rates(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def format(self) -> str:
        rates = ", ".join(f"{r:.2%}" for r in self.per_position_rates())
        return (
            f"MTP Statistics:\n"
            f"  Total draft tokens: {self.num_draft_tokens}\n"
            f"  Accepted tokens:    {self.num_accepted_tokens}\n"
            f"  Acceptance rate:    {self.acceptance_rate:.2%}\n"
            f"  Acceptance rate by position: [{rates}]\n"
            f"  Mean accepted length: {self.mean_accepted_length:.2f}"
        )


def merge_spec_stats(stats: list[SpecDecodeStats]) -> SpecDecodeStats:
    """Several engines' statistics as one (``-dp`` replicas): the counts add up, position by position."""
    return SpecDecodeStats(
        sum(s.num_drafts for s in stats),
        sum(s.num_draft_tokens for s in stats),
        sum(s.num_accepted_tokens for s in stats),
        [sum(p) for p in zip(*(s.drafted_per_position for s in stats), strict=True)],
        [sum(p) for p in zip(*(s.accepted_per_position for s in stats), strict=True)],
    )


class SpecStats:
    """The scheduler's running counts."""

    def __init__(self, num_speculative_tokens: int):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.drafted_per_position = [0] * num_speculative_tokens
        self.accepted_per_position = [0] * num_speculative_tokens

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        logged = self.num_draft_tokens // _LOG_EVERY
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for k in range(num_drafts):
            self.drafted_per_position[k] += 1
            self.accepted_per_position[k] += k < num_accepted
        if self.num_draft_tokens // _LOG_EVERY > logged:
            s = self.snapshot()
            logger.info(
                "speculative decoding: %d draft tokens, %.2f%% accepted, mean accepted length %.2f",
                s.num_draft_tokens,
                100 * s.acceptance_rate,
                s.mean_accepted_length,
            )

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.drafted_per_position),
            list(self.accepted_per_position),
        )
