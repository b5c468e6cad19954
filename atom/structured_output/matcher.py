"""One request's position in its grammar: which tokens may come next, and advancing on the sampled ones."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from atom.structured_output.xgrammar_import import xgrammar

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)


class GrammarState:
    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: Sequence[int] | None = None):
        """``stop_token_ids``: the ids that end the output once the grammar is complete
        (default: the tokenizer's EOS)."""
        self._matcher = xgrammar().GrammarMatcher(
            compiled, override_stop_tokens=list(stop_token_ids) if stop_token_ids else None
        )
        self.num_accepted = 0

    def accept(self, tokens: Sequence[int]) -> bool:
        """Advance over the sampled tokens; False (and the state stays before the offending
        token) if one breaks the grammar. Tokens after termination are ignored."""
        for token in tokens:
            if self._matcher.is_terminated():
                return True
            if not self._matcher.accept_token(int(token)):
                logger.error("Token %d breaks the grammar after %d accepted tokens", token, self.num_accepted)
                return False
            self.num_accepted += 1
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words, a set bit allows)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return self._matcher.is_terminated()
