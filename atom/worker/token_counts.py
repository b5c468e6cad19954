"""Per-request token counts kept on the device between steps, for the penalties.

Rebuilding the counts from the token lists each step costs host time in the length of the
histories; here a request's prompt mask and output counts are written once when it joins and
then grow by the sampled tokens with one scatter on the device per step (no host sync, so it
also works when the sampled ids are still on their way to the host). Rows are allocated on
first use, for ``max_num_seqs`` requests plus row 0, which stays zero for requests without
penalties.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TokenCounts:
    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device | str):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._max = max_num_seqs
        self._slots: dict[str, int] = {}
        self._free = list(range(max_num_seqs, 0, -1))
        self._prompt: torch.Tensor | None = None  # uint8 [max + 1, V]: token in the prompt
        self._output: torch.Tensor | None = None  # int32 [max + 1, V]: times in the output

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int] = ()):
        """Start counting for a request (its outputs so far too: a resumed request)."""
        if not self._free:
            raise RuntimeError(f"TokenCounts holds {self._max} requests already")
        if self._prompt is None:
            self._prompt = torch.zeros(self._max + 1, self.vocab_size, dtype=torch.uint8, device=self.device)
            self._output = torch.zeros(self._max + 1, self.vocab_size, dtype=torch.int32, device=self.device)
        slot = self._free.pop()
        self._slots[request_id] = slot
        self._prompt[slot].zero_()
        self._output[slot].zero_()
        self._prompt[slot, torch.tensor(list(prompt_token_ids), dtype=torch.int64, device=self.device)] = 1
        outputs = torch.tensor(list(output_token_ids), dtype=torch.int64, device=self.device)
        self._output[slot].index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.int32))

    def remove_request(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._slots

    def record(self, request_ids: Sequence[str], tokens: torch.Tensor) -> None:
        """Count ``tokens[i]`` (on the device) for ``request_ids[i]``; untracked ids are skipped."""
        picked = [(i, self._slots[rid]) for i, rid in enumerate(request_ids) if rid in self._slots]
        if not picked:
            return
        positions, slots = zip(*picked)
        rows = torch.tensor(slots, dtype=torch.int64, device=self.device)
        new = tokens.to(self.device)[torch.tensor(positions, dtype=torch.int64, device=self.device)].long()
        self._output.index_put_((rows, new), torch.ones_like(new, dtype=torch.int32), accumulate=True)

    def rows(self, request_ids: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt_counts, output_counts) [B, V] in ``request_ids`` order; zeros for untracked ids."""
        if self._prompt is None:
            zeros = torch.zeros(len(request_ids), self.vocab_size, dtype=torch.int32, device=self.device)
            return zeros, zeros
        index = torch.tensor([self._slots.get(rid, 0) for rid in request_ids], dtype=torch.int64, device=self.device)
        return self._prompt.index_select(0, index), self._output.index_select(0, index)
