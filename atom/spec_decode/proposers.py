"""The two proposers: MTP (the checkpoint's next-n prediction layer drafts from the target's
hidden states, as DeepSeek-V3 and vLLM run it) and shared weights (a test mode: the target
model drafts for itself, so greedy drafts are all accepted)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from atom.forward_context import set_forward_context
from atom.host_copy import to_device
from atom.spec_decode.proposer import DraftInputs, DraftModel, rows_metadata


class _DraftLoop:
    """``K`` single-token draft steps per row, each feeding its argmax to the next."""

    def __init__(
        self,
        forward: Callable,
        compute_logits: Callable,
        layer_map: dict,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        feeds_hidden: bool = True,
    ):
        self.forward, self.compute_logits, self.layer_map = forward, compute_logits, layer_map
        # whether a step's hidden states feed the next (MTP) or are dropped (a shared-weights
        # draft is the target, whose graphs take ids and positions only)
        self.feeds_hidden = feeds_hidden
        self.block_size, self.max_model_len, self.device = block_size, max_model_len, device
        # the draft's decode graphs (MTP on CUDA: the runner's CUDAGraphRunner, set at start-up)
        self.graphs = None

    def forward_rows(self, ids: torch.Tensor, pos: torch.Tensor, meta, hidden: torch.Tensor | None) -> torch.Tensor:
        """The draft's forward over ``rows_metadata`` rows: a captured graph when one fits."""
        if self.graphs is not None and self.graphs.can_run(meta, ids.shape[0]):
            return self.graphs.run(ids, pos, meta, *(() if hidden is None else (hidden,)))
        with set_forward_context(meta, pos, self.layer_map):
            return self.forward(ids, pos, hidden)

    def run(
        self, step: DraftInputs, positions: list[int], ids: torch.Tensor, hidden: torch.Tensor | None, num_steps: int
    ) -> list[torch.Tensor]:
        """Draft ``num_steps`` tokens after ``ids`` (at ``positions``) for the proposing rows."""
        rows = [step.requests[i] for i in step.propose]
        out = []
        for k in range(num_steps):
            pos, meta = rows_metadata(
                rows, [p + k for p in positions], [1] * len(rows), self.block_size, self.max_model_len, self.device,
                decode_rows=True,
            )
            hidden = self.forward_rows(ids, pos, meta, hidden if self.feeds_hidden else None)
            ids = self.compute_logits(hidden).argmax(dim=-1)
            out.append(ids)
        return out


class MtpProposer:
    """Runs the draft over the step's kept tokens first: position ``p`` takes the token at
    ``p + 1`` and the target's hidden state at ``p``, which fills the draft's own KV cache
    and gives the first draft from the last kept position. The one MTP layer then runs
    ``K - 1`` more times on its own output (as DeepSeek-V3 and vLLM reuse it)."""

    def __init__(
        self,
        draft: DraftModel,
        num_speculative_tokens: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        attn_layers: list[nn.Module],
    ):
        self.draft, self.num_speculative_tokens = draft, num_speculative_tokens
        self.attn_layers = attn_layers
        self.layer_map = {m.prefix: m for m in attn_layers}
        self.loop = _DraftLoop(draft.forward, draft.compute_logits, self.layer_map, block_size, max_model_len, device)

    def propose(self, step: DraftInputs) -> torch.Tensor:
        rows = [i for i, n in enumerate(step.num_kept) if n]
        ids, gather, first = [], [], {}
        for i in rows:
            seq, s, n = step.requests[i], step.starts[i], step.num_kept[i]
            ids += seq.token_ids[s + 1 : s + n] + [step.next_tokens[i]]
            gather += range(step.offsets[i], step.offsets[i] + n)
            first[i] = len(ids) - 1  # the row's last kept position
        loop, device = self.loop, step.hidden.device
        kept = [step.num_kept[i] for i in rows]
        pos, meta = rows_metadata(
            [step.requests[i] for i in rows],
            [step.starts[i] for i in rows],
            kept,
            loop.block_size,
            loop.max_model_len,
            device,
            decode_rows=max(kept) <= self.num_speculative_tokens + 1,  # a verify step's, not a prompt chunk
        )
        hidden = loop.forward_rows(to_device(ids, torch.int64, device), pos, meta,
                                   step.hidden[to_device(gather, torch.int64, device)])  # fmt: skip
        if not step.propose:
            return torch.empty(0, self.num_speculative_tokens, dtype=torch.int64)
        last = hidden[to_device([first[i] for i in step.propose], torch.int64, device)]
        d1 = self.draft.compute_logits(last).argmax(dim=-1)
        positions = [step.starts[i] + step.num_kept[i] for i in step.propose]
        rest = loop.run(step, positions, d1, last, self.num_speculative_tokens - 1)
        return torch.stack([d1, *rest], dim=1)


class SharedWeightsProposer:
    """Test mode: the target model drafts, in its own KV cache, from the token just sampled;
    the verify step rewrites the same slots with the same values, or with the true tokens
    where a draft is rejected."""

    def __init__(
        self,
        target: nn.Module,
        forward: Callable,
        num_speculative_tokens: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        layer_map: dict,
    ):
        self.num_speculative_tokens = num_speculative_tokens
        self.attn_layers: list[nn.Module] = []  # the target's, which have their cache already
        self.loop = _DraftLoop(
            lambda ids, pos, _: forward(ids, pos), target.compute_logits, layer_map, block_size, max_model_len, device,
            feeds_hidden=False,
        )

    def propose(self, step: DraftInputs) -> torch.Tensor:
        if not step.propose:
            return torch.empty(0, self.num_speculative_tokens, dtype=torch.int64)
        positions = [step.starts[i] + step.num_kept[i] for i in step.propose]
        ids = to_device([step.next_tokens[i] for i in step.propose], torch.int64, step.hidden.device)
        return torch.stack(self.loop.run(step, positions, ids, None, self.num_speculative_tokens), dim=1)
