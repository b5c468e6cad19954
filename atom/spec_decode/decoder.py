"""The model runner's part of speculative decoding, after the target's forward: verify each
row's drafts (rejection sampling over the logits at the draft positions), then ask the
proposer for the next drafts. Runs synchronously: the accepted counts go to the host
before the proposer builds its inputs (the engine does not overlap speculative steps)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from atom.config import Config
from atom.core_types import SchedulerOutput
from atom.distributed.parallel_state import TPInfo
from atom.host_copy import to_device
from atom.layers.attention import Attention
from atom.sampling_params import SamplingParams
from atom.spec_decode.proposer import DraftInputs, Proposer
from atom.spec_decode.proposers import MtpProposer, SharedWeightsProposer
from atom.spec_decode.rejection_sampler import rejection_sample

logger = logging.getLogger(__name__)


def speculates(params: SamplingParams) -> bool:
    """Whether a request gets drafts. Logprobs, logits processing and a grammar's mask are
    computed for one sampled position per step, so such requests decode one token at a time."""
    return params.logprobs is None and not params.processes_logits and params.structured_outputs is None


class SpecDecoder:
    def __init__(self, proposer: Proposer, target: nn.Module):
        self.proposer, self.target = proposer, target
        self.k = proposer.num_speculative_tokens

    @property
    def attn_layers(self) -> list[nn.Module]:
        return self.proposer.attn_layers

    def step(
        self, batch: SchedulerOutput, rows: list[int], cu: list[int], hidden: torch.Tensor, tokens: torch.Tensor, st
    ) -> tuple[torch.Tensor, tuple[dict[int, list[int]], dict[int, list[int]]]]:
        """``rows``: the sampling rows, ``tokens`` their sampled tokens (from the logits of each
        row's last position), ``st`` their ``SamplingTensors``, ``cu`` the rows' token
        offsets in ``hidden``. Returns the tokens that follow each row's accepted drafts, and
        (row -> accepted drafts, row -> next drafts)."""
        verify = [j for j, i in enumerate(rows) if i in batch.num_drafts]
        accepted: dict[int, list[int]] = {}
        if verify:
            tokens = tokens.clone()
            finals = self._verify(batch, [rows[j] for j in verify], cu, hidden, tokens, verify, st, accepted)
            tokens[to_device(verify, torch.int64, tokens.device)] = finals
        sampled = tokens.tolist() if rows else []
        kept = [n - batch.num_drafts.get(i, 0) + len(accepted.get(i, ())) for i, n in enumerate(batch.num_new_tokens)]
        nxt = [
            seq.token_ids[s + n] if s + n < len(seq.token_ids) else -1
            for seq, s, n in zip(batch.requests, batch.starts, batch.num_new_tokens)
        ]
        for j, i in enumerate(rows):
            nxt[i] = sampled[j]
        propose = [i for i in rows if speculates(batch.requests[i].sampling_params)]
        # called without rows to propose for as well: an MTP draft reads every chunk
        step = DraftInputs(batch.requests, batch.starts, kept, nxt, cu[:-1], hidden, propose)
        drafts = dict(zip(propose, self.proposer.propose(step).tolist()))
        return tokens, (accepted, drafts)

    def _verify(self, batch, vrows, cu, hidden, tokens, verify, st, accepted) -> torch.Tensor:
        k, device = self.k, hidden.device
        idx, draft_ids, counts = [], [], []
        for i in vrows:
            n, end, seq = batch.num_drafts[i], cu[i + 1] - 1, batch.requests[i]
            # position ``end - n + t`` predicts draft ``t`` (0-based); padding repeats the last
            idx += [end - n + min(t, n - 1) for t in range(k)]
            s = batch.starts[i]
            draft_ids.append(seq.token_ids[s + 1 : s + 1 + n] + [0] * (k - n))
            counts.append(n)
        logits = self.target.compute_logits(hidden[to_device(idx, torch.int64, device)]).float()
        sel = to_device(verify, torch.int64, tokens.device)
        pick = lambda t: None if t is None else t[sel]  # noqa: E731
        out = rejection_sample(
            logits.view(len(vrows), k, -1),
            to_device(draft_ids, torch.int64, device),
            to_device(counts, torch.int64, device),
            tokens[sel],
            st.temperatures[sel],
            pick(st.top_k),
            pick(st.top_p),
            pick(st.min_p),
            [st.generators[j] for j in verify],
            all_greedy=st.all_greedy or None,  # a mixed batch's verify rows may still all be greedy
        ).tolist()
        finals = []
        for i, row in zip(vrows, out):
            a = sum(1 for t in row if t != -1) - 1
            accepted[i] = row[:a]
            finals.append(row[a])
        return to_device(finals, tokens.dtype, tokens.device)


def build_spec_decoder(
    config: Config, target: nn.Module, forward: Callable, device: torch.device, tp: TPInfo
) -> SpecDecoder | None:
    """The runner's speculative decoder, or None without speculative decoding."""
    sc, mc = config.speculative_config, config.model_config
    if sc.method is None:
        return None
    k, bs = sc.num_speculative_tokens, config.cache_config.block_size
    if sc.method == "shared_weights":
        layer_map = {m.prefix: m for m in target.modules() if isinstance(m, Attention)}
        proposer = SharedWeightsProposer(target, forward, k, bs, mc.max_model_len, device, layer_map)
    else:
        from atom.spec_decode.mtp_loader import load_mtp

        draft = load_mtp(mc, target, device, tp)
        layers = [m for m in draft.modules() if isinstance(m, Attention)]
        proposer = MtpProposer(draft, k, bs, mc.max_model_len, device, layers)
    logger.info("speculative decoding: method %s, %d draft tokens per step", sc.method, k)
    return SpecDecoder(proposer, target)
